"""Completion text decoded once, when its request finishes, instead of token by token as it runs.

vLLM detokenizes every running request on the engine's thread every step, and a request that asks
for logprobs (all of ours: `logprobs=0`) also has each sampled token converted to its token
string for the logprob record, which nothing here reads. On the arithmetic example that was a
fifth of the engine thread's Python time per step. A request with `detokenize=False` skips
both; `fill_texts` then gives each finished sample the text vLLM would have given it, by running
vLLM's own incremental detokenizer (primed with the prompt, the stop token left out unless
`include_stop_str_in_output`) over its tokens once.

Stop strings are matched on the growing text, so a request that has any keeps vLLM's per-step
detokenization (`decodable_at_finish`).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any


def decodable_at_finish(stop: Sequence[str] | None) -> bool:
    """Whether a request with these stop strings can be sent with `detokenize=False` and get its
    text from `fill_texts` (only without stop strings: vLLM matches them on the growing text)."""
    return not stop


def fill_texts(tokenizer: Any, output: Any, params: Any) -> None:
    """Sets the text of every sample of the finished request `output` (a vLLM RequestOutput)
    that was sampled with `params.detokenize=False`: exactly what vLLM's detokenizer would have
    made of its tokens. A request vLLM detokenized itself is left as it is."""
    if params.detokenize:
        return
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    # What vLLM's detokenizer reads of the request it was made for (it runs with the request's
    # own sampling parameters: special tokens, spaces, whether the stop token is shown).
    request = SimpleNamespace(request_id=output.request_id, prompt_token_ids=list(output.prompt_token_ids or []),
                              sampling_params=params)
    for sample in output.outputs:
        detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
        # A request without stop strings stops on a token (EOS or `stop_token_ids`) exactly when
        # its finish reason is "stop", which is what vLLM's output processor tells the detokenizer.
        detokenizer.update(list(sample.token_ids), sample.finish_reason == "stop")
        sample.text = detokenizer.get_next_output_text(finished=True, delta=False)

"""Transfer check: held-out greedy accuracy on reasoning-gym gsm_symbolic word problems, for `titanrl eval`.

    titanrl eval ~/.cache/titanrl/models/smollm2-135m-instruct --config examples/reasoning/eval_gsm.py  # before
    titanrl eval runs/reasoning --config examples/reasoning/eval_gsm.py                                # after

`titanrl eval CHECKPOINT` takes an HF checkpoint folder, a run directory (its final policy) or a
training checkpoint; the model in this config is replaced by CHECKPOINT. The rest is config.py's
(rewards, weights, answer convention: a final `Answer: N` line, so a correct answer needs the
format the run learned), with 200 held-out gsm_symbolic problems (reasoning-gym's default config)
as data.eval_rows and a longer budget: a word problem needs a few lines of working. `--k 8` adds
pass@8 at rollout.sampling.temperature. Expect small numbers from a 135M model: the check is whether they
move, up or down, after training on chain_sum.
"""

import dataclasses

import titanrl
from config import make_config as chain_sum_config  # config.py beside this file (its folder is on sys.path)
from task import gsm_symbolic_data

MAX_NEW_TOKENS = 256
"""Token budget of each greedy answer (chain_sum's 64 is too short for working through a word problem)."""


def make_config() -> titanrl.RunConfig:
    config = chain_sum_config(data=gsm_symbolic_data(eval_size=200))
    return dataclasses.replace(
        config,
        # Questions are ~150-250 tokens under the chat template; + 256 new tokens.
        rollout=dataclasses.replace(
            config.rollout,
            engine=dataclasses.replace(config.rollout.engine, max_model_len=640),
            sampling=dataclasses.replace(config.rollout.sampling, max_new_tokens=MAX_NEW_TOKENS),
        ),
        eval=dataclasses.replace(config.eval, max_prompts=200, max_new_tokens=MAX_NEW_TOKENS),
    )

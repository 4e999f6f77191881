"""Data sources through `datasets` (JSON, JSON lines, Parquet, CSV, a saved dataset, rows in
memory), chat messages rendered by a real chat template, malformed rows refused with their
index and field, and the shuffle position restored exactly on resume. No network: every
dataset here is written locally."""

from __future__ import annotations

import dataclasses
import json

import datasets
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from titanrl.chat import render_chat
from titanrl.config import ConfigError, DataConfig, ModelConfig, RunConfig, validate
from titanrl.data import DatasetError, PromptStream, load_rows, load_run_rows, render_messages
from titanrl.models.tokenizer import EOS_TOKEN, build_byte_tokenizer
from titanrl.rundir.driver_state import DRIVER_STATE, read_driver_state, write_driver_state
from titanrl.config.record import config_record

ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(6)]

# A template of another shape than ChatML (tools first, `[role]` headers), so a test can tell
# it was used; it writes the BOS token itself, as Llama-style templates do.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}[tools]{% for t in tools %}{{ t | tojson }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def _tokenizer(adds_bos: bool = False) -> PreTrainedTokenizerFast:
    """The byte-level tokenizer with TEMPLATE; `adds_bos`: encoding prepends BOS (a post-processor)."""
    from tokenizers import processors

    raw = build_byte_tokenizer()
    if adds_bos:
        raw.post_processor = processors.TemplateProcessing(
            single=f"{EOS_TOKEN} $A", special_tokens=[(EOS_TOKEN, raw.token_to_id(EOS_TOKEN))])
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                   pad_token=EOS_TOKEN, chat_template=TEMPLATE)


# ----------------------------------------------------------------------------- formats


def _write(tmp_path, kind: str) -> str:
    dataset = datasets.Dataset.from_list(ROWS)
    if kind == "jsonl":
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif kind == "json-array":
        path = tmp_path / "rows.json"
        path.write_text(json.dumps(ROWS))
    elif kind == "parquet-shards":  # the layout of a hub dataset's files: train-0000N-of-0000M.parquet
        for k in range(2):
            dataset.select(range(3 * k, 3 * k + 3)).to_parquet(str(tmp_path / f"train-0000{k}-of-00002.parquet"))
        return str(tmp_path / "train-*.parquet")
    elif kind == "csv":
        path = tmp_path / "rows.csv"
        dataset.to_csv(str(path), index=False)
    elif kind == "saved":
        path = tmp_path / "saved"
        dataset.save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("kind", ["jsonl", "json-array", "parquet-shards", "csv", "saved"])
def test_every_file_format_reads_the_same_rows_in_order(tmp_path, kind):
    """JSON lines, a JSON array, sharded Parquet through a glob, CSV and a save_to_disk directory
    all give the written rows, in order (CSV with its column types inferred: answers become ints)."""
    rows = load_rows(_write(tmp_path, kind))
    expected = [{**r, "answer": int(r["answer"])} for r in ROWS] if kind == "csv" else ROWS
    assert rows == expected


@pytest.mark.parametrize("make", [lambda: list(ROWS), lambda: datasets.Dataset.from_list(ROWS)], ids=["list", "Dataset"])
def test_rows_in_memory(make):
    """A list of dicts and a datasets.Dataset are sources too."""
    assert load_rows(make(), label="data.train_rows") == ROWS


def test_a_dataset_dict_and_an_unknown_suffix_are_refused_with_what_to_do(tmp_path):
    """A DatasetDict (in memory or saved) asks for one split; an unknown suffix lists the formats."""
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS)})
    with pytest.raises(DatasetError, match=r"splits \['test', 'train'\].*dataset\['test'\]"):
        load_rows(splits, label="data.train_rows")
    splits.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match="point at one split's directory"):
        load_rows(tmp_path / "dd")
    (tmp_path / "rows.txt").write_text("x\n")
    with pytest.raises(DatasetError, match=r"unknown data format '.txt'; use .jsonl, .json, .parquet, .csv"):
        load_rows(tmp_path / "rows.txt")


def test_validation_accepts_globs_saved_datasets_and_rows_and_refuses_both_sources(tmp_path):
    """validate() checks where rows come from: a glob must match, a directory must be a saved
    dataset, rows in memory exclude a file, and a non-row object is named."""
    from titanrl.models.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    base = RunConfig(model=ModelConfig(checkpoint=str(ckpt)), rewards=[lambda p, c, **f: 0.0])

    def check(**data):
        validate(dataclasses.replace(base, data=DataConfig(**data)))

    check(train_file=_write(tmp_path, "parquet-shards"))
    check(train_file=_write(tmp_path, "saved"))
    check(train_rows=list(ROWS), eval_rows=datasets.Dataset.from_list(ROWS))
    for data, message in [
        (dict(train_file=str(tmp_path / "nothing-*.parquet")), "pattern matches no file"),
        (dict(train_file=str(ckpt)), "not one written by datasets.Dataset.save_to_disk"),
        (dict(train_file=_write(tmp_path, "jsonl"), train_rows=list(ROWS)), "both set"),
        (dict(train_rows={"prompt": "x"}), "data.train_rows must be a list of dicts or a datasets.Dataset"),
        (dict(), "data.train_file is empty"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check(**data)


def test_config_record_keeps_the_count_of_rows_in_memory_not_the_rows():
    """config.json stays small and comparable on resume: in-memory rows are recorded by count."""
    record = config_record(RunConfig(data=DataConfig(train_rows=list(ROWS), eval_rows=datasets.Dataset.from_list(ROWS[:2]))))
    assert record["data"]["train_rows"] == "6 rows in memory" and record["data"]["eval_rows"] == "2 rows in memory"
    assert RunConfig().data.train_rows is None and config_record(RunConfig())["data"]["train_rows"] is None


# ----------------------------------------------------------------------------- malformed rows


@pytest.mark.parametrize("kind", ["parquet-shards", "csv", "saved", "list"])
def test_a_row_without_the_prompt_field_fails_with_its_index_and_the_field(tmp_path, kind):
    """Row 4 of 6 lacks the prompt: the message names the source, index 4 and 'prompt'."""
    rows = [dict(r) for r in ROWS]
    rows[4] = {"question": "9+9=", "answer": "18"}
    if kind == "list":
        source, where = rows, "data.train_rows row 4"
    else:
        # Same columns in every row (the formats are tables): row 4's prompt is null.
        table = [{"prompt": r.get("prompt"), "answer": r["answer"]} for r in rows]
        dataset = datasets.Dataset.from_list(table)
        if kind == "parquet-shards":
            dataset.to_parquet(str(tmp_path / "train-00000-of-00001.parquet"))
            source = str(tmp_path / "train-*.parquet")
        elif kind == "csv":
            source = str(tmp_path / "rows.csv")
            dataset.to_csv(source, index=False)
        else:
            source = str(tmp_path / "saved")
            dataset.save_to_disk(source)
        where = f"{source} row 4"
    with pytest.raises(DatasetError) as info:
        load_rows(source, label="data.train_rows")
    assert f"{where} needs a string field 'prompt' (data.prompt_field)" in str(info.value)


def test_malformed_messages_fail_with_row_message_and_field():
    """With messages_field, a row without messages, an empty list and a message without content
    are each named by row index, message index and the missing key."""
    good = {"messages": [{"role": "user", "content": "hi"}]}
    cases = [({"prompt": "x"}, "row 1 needs a field 'messages' (data.messages_field)"),
             ({"messages": []}, "row 1 needs a field 'messages'"),
             ({"messages": [{"role": "system", "content": "s"}, {"role": "user"}]},
              "row 1: message 1 of 'messages' needs a string field 'content'")]
    for bad, message in cases:
        with pytest.raises(DatasetError) as info:
            load_rows([good, bad], messages_field="messages", label="data.train_rows")
        assert message in str(info.value)


def test_load_run_rows_refuses_a_malformed_row_before_any_actor(tmp_path):
    """The driver's loader (run before actors start) stops on the malformed row with its index."""
    from titanrl.models.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    rows = list(ROWS) + [{"answer": "1"}]
    config = RunConfig(model=ModelConfig(checkpoint=str(ckpt)), data=DataConfig(train_rows=rows))
    with pytest.raises(DatasetError, match="data.train_rows row 6 needs a string field 'prompt'"):
        load_run_rows(config)


# ----------------------------------------------------------------------------- chat templates


def test_messages_are_rendered_with_the_checkpoint_template(tmp_path):
    """data.messages_field: load_run_rows renders each row's messages with the checkpoint
    tokenizer's own template (not ChatML) into the prompt field, with the generation prompt, and
    keeps the messages and other fields for the rewards."""
    ckpt = tmp_path / "ckpt"
    _tokenizer().save_pretrained(str(ckpt))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    config = RunConfig(model=ModelConfig(checkpoint=str(ckpt)),
                       data=DataConfig(train_rows=[{"chat": messages, "answer": "4"}], messages_field="chat"))
    (row,), _ = load_run_rows(config)
    assert row == {"chat": messages, "answer": "4",
                   "prompt": f"{EOS_TOKEN}[system] Be brief.\n[user] 2+2?\n[assistant] "}


def test_a_string_field_is_one_user_message_after_the_system_prompt(tmp_path):
    """A GSM8K-style row (`question` text) renders as one user turn; data.system_prompt goes first
    unless the row's messages bring their own system message; it needs data.messages_field."""
    ckpt = tmp_path / "ckpt"
    _tokenizer().save_pretrained(str(ckpt))
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "3+3?"}]
    rows = [{"question": "2+2?", "answer": "#### 4"}, {"question": own, "answer": "#### 6"}]
    config = RunConfig(model=ModelConfig(checkpoint=str(ckpt)),
                       data=DataConfig(train_rows=rows, messages_field="question", system_prompt="End with #### N."))
    train, _ = load_run_rows(config)
    assert [r["prompt"] for r in train] == [f"{EOS_TOKEN}[system] End with #### N.\n[user] 2+2?\n[assistant] ",
                                            f"{EOS_TOKEN}[system] Mine.\n[user] 3+3?\n[assistant] "]
    assert [r["answer"] for r in train] == ["#### 4", "#### 6"]
    from titanrl.models.tiny import write_tiny_checkpoint

    no_field = RunConfig(model=ModelConfig(checkpoint=str(write_tiny_checkpoint(tmp_path / "tiny"))),
                         data=DataConfig(train_rows=rows, system_prompt="x"), rewards=[lambda p, c, **f: 0.0])
    with pytest.raises(ConfigError, match="data.system_prompt is set but data.messages_field is empty"):
        validate(no_field)


def test_render_chat_tools_bos_and_the_chatml_fallback():
    """Tool schemas reach a template that reads `tools`; a template's own BOS is dropped when the
    tokenizer adds one on encoding (never two); a tokenizer without a template gets ChatML; a
    template that ignores tools is refused rather than losing them."""
    from transformers.utils import get_json_schema

    def add(a: int, b: int) -> int:
        """Adds.

        Args:
            a: first
            b: second
        """
        return a + b

    schema = get_json_schema(add)
    user = [{"role": "user", "content": "1+2?"}]
    assert render_chat(_tokenizer(), user, tools=[schema]) == (
        f"{EOS_TOKEN}[tools]{json.dumps(schema)};[user] 1+2?\n[assistant] ")  # HF trims a newline after a block tag
    with_bos = _tokenizer(adds_bos=True)
    text = render_chat(with_bos, user)
    assert text == "[user] 1+2?\n[assistant] "
    assert with_bos(text)["input_ids"].count(with_bos.bos_token_id) == 1
    plain = _tokenizer()
    plain.chat_template = None
    assert render_chat(plain, user) == "<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n"
    assert render_messages([{"m": user}], None, "m", "prompt")[0]["prompt"] == render_chat(plain, user)
    with pytest.raises(ValueError, match="does not render tools"):
        render_chat(plain, user, tools=[schema])


# ----------------------------------------------------------------------------- shuffle resume


def test_shuffle_position_survives_a_checkpoint_and_resumes_the_same_batches(tmp_path):
    """A stream checkpointed mid-epoch (through driver.pt, as the driver writes it) and restored
    into a fresh stream over the same rows, read back from Parquet, yields exactly the batches the
    uninterrupted stream yields next, across epoch boundaries; other rows are refused."""
    rows = [{"prompt": f"p{i}", "i": i} for i in range(7)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    reference = PromptStream(rows, 3, seed=11)
    for _ in range(4):  # 12 draws: one epoch of 7 and 5 into the next
        reference.next_batch()
    write_driver_state(tmp_path / DRIVER_STATE, {"stream": reference.state_dict()})
    state = read_driver_state(tmp_path)["stream"]
    resumed = PromptStream(load_rows(tmp_path / "train.parquet"), 3, seed=999)  # the seed lives in the state
    resumed.load_state_dict(state)
    upcoming = [[r["i"] for r in reference.next_batch()] for _ in range(6)]
    assert [[r["i"] for r in resumed.next_batch()] for _ in range(6)] == upcoming
    fresh = PromptStream(rows, 3, seed=11)
    assert [[r["i"] for r in fresh.next_batch()] for _ in range(10)][4:] == upcoming  # the same stream, no skip
    with pytest.raises(DatasetError, match="has 8 usable rows but the checkpoint was taken with 7: resume needs the same data.train_file"):
        PromptStream(rows[:7] + rows[:1], 3, seed=11).load_state_dict(state)
    assert isinstance(torch.load(tmp_path / DRIVER_STATE, weights_only=True), dict)

"""Generated prompt sources: rows made by a generator instead of read from files.

Each source returns `datasets.Dataset` rows that go into `DataConfig(train_rows=..., eval_rows=...)`
(or onto disk with `Dataset.to_parquet` / `save_to_disk`, for `data.train_file`), so they are
checked, chat-rendered and shuffled like the rows of any other source (`titanrl.data`).

- `titanrl.data_sources.reasoning_gym`: procedural reasoning tasks of the `reasoning-gym`
  package, scored by `titanrl.rewards.reasoning_gym`.

Modules here import their generator package only when called: `import titanrl` stays cheap.
"""

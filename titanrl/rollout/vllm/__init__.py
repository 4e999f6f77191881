"""vLLM inside TitanRL: the engine wrapper (`engine`), our model registered into vLLM's
registry (`model`, `plugin`), the worker extension for in-place weight pushes
(`worker_extension`), attention over vLLM's paged cache (`paged_attention`) and the async
generator (`async_engine`)."""

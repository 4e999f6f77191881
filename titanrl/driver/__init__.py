"""`titanrl.train(config)` and what it drives: the run loop (`loop`), the actors and their
placement (`actors`, `placement`), Ray start-up (`ray_runtime`) and the rollout sources
(`sources`). The entry point is `titanrl.driver.train.train`."""

"""Agents written against the OpenAI API, trained through the rollout workers' own endpoint.

`RunConfig.agent = titanrl.AgentConfig(fn=agent)`: each episode is one call of
`agent(base_url, api_key, row) -> reward`, which may use any OpenAI client. The worker serves
`/v1/chat/completions` and `/v1/completions` from its engine (`server`, `handler`), records
every call token for token and assembles the episode's samples from those ids (`calls`).

An agent file imports only `episode_sandbox` from here (and only if it runs code).
"""

from titanrl.agents.sandbox import EpisodeSandbox, episode_sandbox

__all__ = ["EpisodeSandbox", "episode_sandbox"]

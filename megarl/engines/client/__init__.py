"""Running engines as seen over HTTP: SGLang 0.5.23's API (`sglang_api`), sampling parameters, bearer keys,
one replica's client, the `Fleet` of every replica's client, the router over clients. What agents import."""

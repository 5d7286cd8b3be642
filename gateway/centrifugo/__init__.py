"""Centrifugo compatibility (docs/centrifugo.md): its server API under `centrifugo.api_prefix`, as the `cent`
client and Centrifugo's HTTP API users call it, over the same topics, router and user control as our admin API."""

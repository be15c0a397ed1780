"""Verifiable rewarders, one module per kind (math, code, ifeval), and the rewarder table that names them
(`gapo.reward.registry.REWARDERS`: per kind its record check, scorer and metrics). The entry point for scoring is
`registry.score_groups(kind, groups, problems, cfg)`; every rewarder returns one `gapo.reward.types.RewardResult`
per response. Modules are imported on use, so importing this package stays cheap."""

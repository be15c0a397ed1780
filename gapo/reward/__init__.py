"""Verifiable rewarders. Entry points: `gapo.reward.math.score_math` and `gapo.reward.code.score_code`
(one group each), `MathVerifier.score_batch` / `CodeRunner.score_batch` (many groups at once, what the
trainer should use); all return `gapo.reward.types.RewardResult` per response. Modules are imported on
use, so importing this package stays cheap."""

"""Which token overflows a frontend may reject before the engine sees a request.

Seed parity: :class:`TokenBudget` is the ``dynamo.common.token_budget`` API. An engine
advertises one as ``EngineConfig.runtime_data[TOKEN_BUDGET_RUNTIME_KEY] =
budget.as_runtime_data()`` (or, as Dynamo's ``publish_token_budget`` writes it, that dict
as JSON text). The gateway then checks prompts against ``combined_limit`` instead of the
context length and rejects only the overflows whose flag is set
(:func:`penstock.serving.limits.check_budget`); ``/metrics`` shows the limit and the
flags (``penstock_frontend_model_context_length``,
``penstock_frontend_model_token_budget_enforced``). Without one, the context length is the
limit and both overflows are rejected.
"""

from dataclasses import dataclass

TOKEN_BUDGET_RUNTIME_KEY = "token_budget"


@dataclass(frozen=True)
class TokenBudget:
    """Advertise which token-overflow requests the frontend may reject early.

    A false flag delegates that overflow dimension to the engine, which then owns any
    clamping, truncation or rejection.
    """

    combined_limit: int
    reject_prompt_overflow: bool
    reject_total_overflow: bool

    def __post_init__(self) -> None:
        if isinstance(self.combined_limit, bool) or not isinstance(self.combined_limit, int):
            raise ValueError("combined_limit must be an integer")
        if self.combined_limit < 0:
            raise ValueError("combined_limit must be >= 0")

    def as_runtime_data(self) -> dict[str, int | bool]:
        return {
            "combined_limit": self.combined_limit,
            "reject_prompt_overflow": self.reject_prompt_overflow,
            "reject_total_overflow": self.reject_total_overflow,
        }

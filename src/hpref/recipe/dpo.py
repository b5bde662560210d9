"""The DPO family's settings, one class for both places a recipe sets them: offline DPO's `[dpo]`
(`hpref.recipe.loading.DpoSection`) and online DPO's `algorithm = { name = "online-dpo", ... }`
(`hpref.rl.algorithms.online_dpo.OnlineDpoConfig`). TRL's `DPOTrainer` names; the loss is
`hpref.models.dpo_loss`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

#: the DPO family's losses (`hpref.models.dpo_loss`)
LossType = Literal["sigmoid", "ipo", "davidson"]


class DpoSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)

    beta: float = Field(0.1, gt=0, description="strength of the implicit KL to the reference (TRL's beta)")
    loss_type: LossType = Field(
        "sigmoid",
        description="sigmoid = DPO (Rafailov 2023; a tie counts half a win each way), ipo = IPO (Azar "
        "2023), davidson = tie-aware DPO-D (Chen 2024: a tie pulls the two implicit rewards together)",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="share of each decisive label assumed flipped (conservative DPO; sigmoid and davidson)",
    )
    tie_strength: float = Field(
        1.0, gt=0, description="davidson: nu, P(tie) = nu / (2 + nu) at equal rewards"
    )

    @field_validator("label_smoothing")
    @classmethod
    def _smoothing_has_a_form(cls, value: float, info: ValidationInfo) -> float:
        loss_type = info.data.get("loss_type", "sigmoid")
        if value and loss_type == "ipo":
            raise ValueError(
                f"{value} is conservative DPO's label noise, for loss_type 'sigmoid' or 'davidson'; IPO "
                "regresses a margin and has no smoothed form (set label_smoothing = 0)"
            )
        return value

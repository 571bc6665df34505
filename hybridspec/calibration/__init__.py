"""Calibration of the length policy (docs/design.md, "Length policy"): acceptance model, cost model, artifact.

Loading an artifact and `AcceptanceModel.predict` need only torch; the fitting functions import
scikit-learn when called (`pip install "hybridspec[calibrate]"`).
"""

from hybridspec.calibration.acceptance import AcceptanceModel, fit_acceptance
from hybridspec.calibration.artifact import (
    SCHEMA_VERSION,
    Calibration,
    current_device_name,
    fingerprint,
    runtime_versions,
)
from hybridspec.calibration.costs import (
    RoundCost,
    RoutingTables,
    best_static_length,
    dinkelbach_rho,
    fit_line,
    fit_round_cost,
    routing_cell_counts,
    routing_tables,
)
from hybridspec.policy import keep_extra_token

__all__ = [
    "SCHEMA_VERSION",
    "AcceptanceModel",
    "Calibration",
    "RoundCost",
    "RoutingTables",
    "best_static_length",
    "current_device_name",
    "dinkelbach_rho",
    "fingerprint",
    "fit_acceptance",
    "fit_line",
    "fit_round_cost",
    "keep_extra_token",
    "routing_cell_counts",
    "routing_tables",
    "runtime_versions",
]

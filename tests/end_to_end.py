"""What the end-to-end task tests on the embedded model share."""

from __future__ import annotations


def small_steering(selectors_dir, direction: str = "E+"):
    """The trait-steering configuration of the end-to-end task tests on the embedded model (two
    candidate layers, four calibration pairs, two CAA scales, the cost on two neutral texts)."""
    from eval_harness.directions import TraitSteeringConfig

    return TraitSteeringConfig(directions=[direction], candidate_layers=[19, 20],
                               calibration_pairs=4, top_layers=1, caa_scales=(1.0, 4.0),
                               cost_texts=2, selectors_dir=str(selectors_dir))

"""Memory inception's exactness on every supported architecture, as numbers.

For each family's tiny float64 config (tests/tiny_models.py): how far the banks move the logits
at all; the largest |difference| between ``steer()`` and the tests' independent
concatenated-softmax reference (target, reference and auxiliary banks, part of the heads at two
layers); and between cached greedy decoding and a full pass under the same banks.

Usage (from the repository root, which holds the tests' helpers):
    python -m experiments.mi_architectures
"""

from __future__ import annotations

import argparse

import torch

from hf_memory import BankSet, steer
from hf_memory.models.adapters import get_adapter
from hf_memory.models.transformers_compat import cache_kwargs, output_cache
from tests.test_memory_inception import ConcatReference, random_bank, token_ids
from tests.tiny_models import FAMILIES, tiny_model


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print(f"{'model_type':<12} {'steering moves':>15} {'steer() vs reference':>21} "
          f"{'cached decode vs full pass':>27}")
    for family in FAMILIES:
        model = tiny_model(family)
        banks = [random_bank("t", "target", 5, gain=1.5, seed=1),
                 random_bank("r", "reference", 3, gain=0.7, seed=2),
                 random_bank("aux", "auxiliary", 4, gain=0.4, seed=3)]
        sites = {1: [0, 3], 2: [1, 2, 3]}
        ids = token_ids(2, 12)
        with torch.no_grad():
            plain = model(ids).logits
            with steer(model, BankSet(banks, gamma=1.3), units=sites,
                       layer_gains={1: 0.8, 2: 0.8}):
                steered = model(ids).logits
                out = model(ids[:, :8], use_cache=True)
                steps = [out.logits]
                for i in range(8, 12):
                    out = model(ids[:, i:i + 1], **cache_kwargs(output_cache(out)),
                                use_cache=True)
                    steps.append(out.logits)
            with ConcatReference(model, banks, sites, rho=0.8, gamma=1.3):
                expected = model(ids).logits
        gap = float((steered - expected).abs().max())
        decode_gap = float((torch.cat(steps, dim=1) - steered).abs().max())
        moved = float((steered - plain).abs().max())
        print(f"{get_adapter(model).model_type:<12} {moved:>15.1e} {gap:>21.1e} "
              f"{decode_gap:>27.1e}")


if __name__ == "__main__":
    main()

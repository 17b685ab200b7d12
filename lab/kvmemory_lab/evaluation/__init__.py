"""Repair-fidelity evaluation (paper §4.2, §4.3, Appendix 7.5, 8): case builders and statistics.

    cases = niah_cases(data_dir, tokenizer, lengths=[1024, 2048], per_length=4)   # Erasing-NIAH
    cases = qa_cases(data_dir, sources_per_dataset=5)                            # natural multi-hop QA
    paired_bootstrap(diff, groups)                                               # source-paired 95 % CI
"""

from .cases import EvalCase
from .multihop import QA_DATASETS, qa_cases
from .niah import niah_cases
from .stats import paired_bootstrap

__all__ = ["EvalCase", "QA_DATASETS", "niah_cases", "paired_bootstrap", "qa_cases"]

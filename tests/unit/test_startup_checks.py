"""Start-up refusals that happen before any argument is parsed."""

import pytest

from megatron.training.initialize import check_torch_version


def test_old_torch_is_refused_with_one_line():
    with pytest.raises(ValueError, match=r"torch 2\.4\.1\+cu121 is too old: need torch >= 2\.5"):
        check_torch_version("2.4.1+cu121")
    check_torch_version("2.5.0")
    check_torch_version("2.13.0+cpu")

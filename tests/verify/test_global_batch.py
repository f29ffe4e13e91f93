"""The global batch follows the world size; an explicit one is validated before training."""

import pytest

from verify.workload.data import global_batch_size
from verify.run.main import main as verify_main


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_default_global_batch_follows_the_world_size(world):
    assert global_batch_size(world, per_rank=2) == 2 * world


def test_explicit_global_batch_must_split_evenly():
    assert global_batch_size(3, per_rank=2, global_batch=9) == 9
    with pytest.raises(ValueError, match=r"Invalid --global-batch=8 for world_size=3\. Must be a positive multiple.*\(e\.g\. 6 or 9\)"):
        global_batch_size(3, per_rank=2, global_batch=8)
    with pytest.raises(ValueError, match=r"Invalid --global-batch=0"):
        global_batch_size(3, per_rank=2, global_batch=0)
    with pytest.raises(ValueError, match=r"Invalid per_rank=0"):
        global_batch_size(3, per_rank=0)


def test_verify_main_rejects_a_bad_global_batch_before_any_process_group(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    code = verify_main(["--out-dir", str(tmp_path), "--global-batch", "8"])
    assert code == 2
    assert "Invalid --global-batch=8 for world_size=3" in capsys.readouterr().err


def test_verify_main_rejects_a_tp_that_does_not_divide_w_before_any_process_group(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert verify_main(["--out-dir", str(tmp_path), "--tp", "3"]) == 2
    assert "Invalid --tp 3 at W=4. Must divide W, the mesh being (W/T) x T" in capsys.readouterr().err

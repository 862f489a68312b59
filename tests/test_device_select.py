"""decoding/device_select.py, the batched tensor form of the threshold and topk rules the static step runs on the
device, row by row against the host rules of decoding/policies.py (which stay their definition)."""
import pytest
import torch

from unmask.decoding.device_select import HOST, THRESHOLD, TOPK, commit_rows, rule_code, threshold_rows, top_n_rows
from unmask.decoding.policies import PolicyConfig, BlockState, clamp_count, threshold, threshold_mask, top_rows, topk
from unmask.decoding.sampling import Proposal


def batch(seed: int, rows: int = 24, k: int = 8):
    """Confidences with ties (values on a coarse grid), each row with 1..K valid columns."""
    g = torch.Generator().manual_seed(seed)
    conf = torch.randint(0, 6, (rows, k), generator=g).float() / 5
    count = torch.randint(1, k + 1, (rows,), generator=g)
    valid = torch.arange(k)[None, :] < count[:, None]
    conf[~valid] = torch.rand(int((~valid).sum()), generator=g) + 2  # padding above every real value: never read
    return conf, valid, count


@pytest.mark.parametrize("seed", range(4))
def test_threshold_rows_equal_threshold_mask_per_row(seed):
    conf, valid, count = batch(seed)
    tau = torch.tensor([0.2, 0.6, 0.9, 1.0] * 6)
    got = threshold_rows(conf, valid, tau)
    for r in range(conf.shape[0]):
        m = int(count[r])
        want = threshold_mask(conf[r, :m].clone(), float(tau[r]))
        assert got[r, :m].tolist() == want.tolist() and not got[r, m:].any()


@pytest.mark.parametrize("seed", range(4))
def test_top_n_rows_equal_top_rows_per_row(seed):
    conf, valid, count = batch(seed)
    n = torch.tensor([0, 1, 2, 3, 4, 8, 20, 5] * 3)
    got = top_n_rows(conf, valid, n)
    for r in range(conf.shape[0]):
        m = int(count[r])
        want = top_rows(conf[r, :m], clamp_count(int(n[r]), m))
        assert got[r, :m].tolist() == want.tolist() and not got[r, m:].any()


def test_the_threshold_compares_in_float32_as_the_host_does():
    """0.9 is not a float32: values one float32 step either side of float32(0.9), and float32(0.9) itself."""
    t = torch.tensor(0.9, dtype=torch.float32)
    conf = torch.stack([torch.nextafter(t, torch.tensor(0.0)), t, torch.nextafter(t, torch.tensor(1.0)),
                        torch.tensor(0.95)])[None, :]
    valid = torch.ones_like(conf, dtype=torch.bool)
    got = threshold_rows(conf, valid, torch.tensor([0.9], dtype=torch.float32))
    assert got[0].tolist() == threshold_mask(conf[0].clone(), 0.9).tolist() == [False, True, True, True]


def test_commit_rows_dispatches_per_row_and_forces_the_first_column():
    """Through the policies' own rule functions: a threshold row, a topk row, a host row, and a forced first
    column (a topk row whose column 0 is not among its top 1)."""
    probs = torch.tensor([[0.95, 0.3, 0.92, 0.1], [0.2, 0.7, 0.6, 0.0], [0.99, 0.99, 0.99, 0.99],
                          [0.1, 0.8, 0.2, 0.5]])
    valid = torch.tensor([[True] * 4, [True, True, True, False], [True] * 4, [True] * 4])
    rule = torch.tensor([THRESHOLD, TOPK, HOST, TOPK])
    got = commit_rows(probs, valid, rule, torch.tensor([0.9, 1.0, 0.5, 1.0]), torch.tensor([0, 2, 3, 1]),
                      torch.tensor([False, False, True, True]))
    state = BlockState(initial_masked=4)

    def host(cfg, row, m):
        p = probs[row, :m]
        prop = Proposal(tokens=torch.zeros(m, dtype=torch.long), probs=p, entropy=p, margin=p, logprobs=p)
        return {"threshold": threshold, "topk": topk}[cfg.name](cfg, prop, state, None).tolist()

    assert got[0].tolist() == host(PolicyConfig(name="threshold", threshold=0.9), 0, 4) == [True, False, True, False]
    assert got[1, :3].tolist() == host(PolicyConfig(name="topk", tokens_per_step=2), 1, 3) and not got[1, 3]
    assert not got[2].any()  # the host decides this one: nothing here, forced first or not
    assert got[3].tolist() == [True, True, False, False]  # its top 1 (column 1) plus the forced column 0
    assert rule_code("threshold") == THRESHOLD and rule_code("topk") == TOPK and rule_code("factor") == HOST

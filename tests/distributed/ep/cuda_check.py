"""Run by test_ep_moe_cuda.py (``python cuda_check.py RENDEZVOUS_FILE``) on a machine with a
GPU: an NCCL world of one rank, the tiny Qwen3-MoE with EPMoE blocks on CUDA, unsharded and
sharded over a 1-rank EP mesh (the counts all_to_all and the autograd all_to_alls then run on
NCCL with CUDA tensors), against the Hugging Face model on CUDA: loss, logits and every grad
within 1e-5 relative (TF32 off). Prints CUDA_CHECK_OK at the end."""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))
dist.init_process_group("nccl", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1,
                        device_id=torch.device("cuda", 0))
import transformers  # noqa: E402

from examples.ep_moe import replace_qwen3_moe_blocks, shard_experts, tiny_qwen3_moe  # noqa: E402
from tests.distributed.ep.ep_tasks import hf_name  # noqa: E402

print("torch", torch.__version__, "transformers", transformers.__version__,
      torch.cuda.get_device_name())
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("ep",))
ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3)).cuda()
hf = tiny_qwen3_moe().cuda()
a = hf(input_ids=ids, labels=ids)
a.loss.backward()
ref = dict(hf.named_parameters())
for sharded in (False, True):
    m = replace_qwen3_moe_blocks(tiny_qwen3_moe()).cuda()
    if sharded:
        shard_experts(m, mesh["ep"])
    b = m(input_ids=ids, labels=ids)
    b.loss.backward()
    torch.cuda.synchronize()
    worst = 0.0
    for n, p in m.named_parameters():
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        assert g.device.type == "cuda", n
        r = ref[hf_name(n)].grad
        worst = max(worst, ((g - r).abs().max() / r.abs().max()).item())
    dl = ((b.logits - a.logits).abs().max() / a.logits.abs().max()).item()
    print(f"sharded={sharded} loss {b.loss.item():.7f} vs hf {a.loss.item():.7f} "
          f"logits rel {dl:.2e} worst grad rel {worst:.2e}")
    assert dl < 1e-5 and worst < 1e-5
print("CUDA_CHECK_OK")
dist.destroy_process_group()

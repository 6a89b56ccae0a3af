"""Hugging Face interop: the native Llama to and from a LlamaForCausalLM directory, a transformers model under tp=2."""

import tempfile

import torch
import transformers

from colo.apps import Booster, HybridParallel, Llama, get_preset
from colo.apps.hf import load_llama_from_hf, save_llama_as_hf
from colo.comm import launch

IDS = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))  # the same batch on every rank


def train(hf_dir, num_steps=2):
    hf_model = transformers.LlamaForCausalLM.from_pretrained(hf_dir)  # the same weights on every rank
    booster = Booster(HybridParallel(tp=2))  # transformers' model under colo's HFLlamaPlan; DDP / Zero need no plan
    booster.boost(hf_model, torch.optim.AdamW(hf_model.parameters(), lr=1e-3))
    return [booster.train_step({"input_ids": IDS, "labels": IDS}).loss for _ in range(num_steps)]  # HF's own loss


if __name__ == "__main__":
    model = Llama(get_preset("tiny"))
    model.init_weights(0)
    with tempfile.TemporaryDirectory() as hf_dir:
        save_llama_as_hf(model, hf_dir)  # config.json + model.safetensors (max_shard_bytes=: shards + index)
        loaded = load_llama_from_hf(hf_dir)  # back to the native Llama, every tensor exact
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), loaded.parameters(), strict=True))
        hf_model = transformers.LlamaForCausalLM.from_pretrained(hf_dir)
        with torch.no_grad():  # different kernels: equal within rounding
            torch.testing.assert_close(hf_model(IDS).logits, model(IDS, return_logits=True).logits)
        losses = launch(train, 2, hf_dir, backend="gloo")[0]  # 2 CPU processes
    optimizer = torch.optim.AdamW(hf_model.parameters(), lr=1e-3)  # the same steps in one process
    for loss in losses:
        expected = hf_model(input_ids=IDS, labels=IDS).loss
        expected.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.testing.assert_close(loss, expected.item(), rtol=1e-5, atol=0)
    print(f"ok: HF round trip exact; transformers Llama at tp=2: losses {losses[0]:.4f}, {losses[1]:.4f} as 1 process")

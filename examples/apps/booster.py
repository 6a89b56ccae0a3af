"""The Booster on 2 ranks: the native Llama as a 2-stage pipeline (1F1B) with ZeRO-1, checked against one process."""

import tempfile

import torch

from colo.apps import Booster, HybridParallel, Llama, get_preset  # also DDP, Zero, Gemini
from colo.apps.models.llama import llama_state_dict_to_hf
from colo.comm import launch
from colo.tensor.checkpoint import load_checkpoint


def make_model():
    model = Llama(get_preset("tiny"))  # 109K parameters
    model.init_weights(0)  # the same on every rank (or materialized from the meta device)
    return model


def make_batches(num_steps=3):  # dicts of tensors, this data-parallel rank's rows (dp=1 here: all of them)
    ids = torch.randint(0, 128, (num_steps, 8, 32), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": step_ids, "labels": step_ids} for step_ids in ids]


def train(checkpoint_dir):
    booster = Booster(HybridParallel(pp=2, num_microbatches=4, schedule="1f1b", zero_stage=1, max_grad_norm=1.0))
    model = make_model()
    model, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=3e-3), lr_scheduler=None)
    losses = [booster.train_step(batch).loss for batch in make_batches()]  # StepResult(loss, grad_norm, ...)
    booster.save(f"{checkpoint_dir}/step-3")  # colo.tensor.checkpoint format; loads under any plugin / layout
    return losses


if __name__ == "__main__":
    reference = make_model()  # the same steps in one process
    optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        losses = launch(train, 2, checkpoint_dir, backend="gloo")[0]  # 2 CPU processes
        for batch, loss in zip(make_batches(), losses):
            expected = reference(**batch).loss
            expected.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            assert abs(loss - expected.item()) < 1e-5 * expected.item(), (loss, expected.item())
        # the checkpoint names parameters as Hugging Face does (q, k and v apart), whatever the layout that saved it
        hf_weights = llama_state_dict_to_hf(reference.state_dict(), reference.config)
        weights = {name.removeprefix("model."): tensor for name, tensor in hf_weights.items()}
        saved = {name: torch.empty_like(tensor) for name, tensor in weights.items()}
        load_checkpoint(f"{checkpoint_dir}/step-3", saved, strict=False)  # strict=False: skip the optimizer state
    for name, tensor in weights.items():  # AdamW turns rounding noise in near-zero gradients into steps of ~lr:
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-4, msg=name)  # 1.2e-5 seen, weights ~0.08
    print(f"ok: pp=2 x ZeRO-1 Llama, losses {', '.join(f'{x:.4f}' for x in losses)} and weights match one process")

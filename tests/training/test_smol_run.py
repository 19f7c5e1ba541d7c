"""A 20-step prompt-tuning run through the 3-server SmolLM2-135M swarm (the session's smol_swarm: CLI servers of
blocks 0:10, 10:20, 20:30, float32) follows the same run done locally with transformers (same seed, same
prompts, same Adam): the loss within 1e-3 relative at every step, and the prompts after the run within 1e-3 of
their largest entry. The tiny task: four short sentences (a padded batch) as a language-modelling target."""

from __future__ import annotations

import torch

from tests.training.test_fine_tuning import local_loss

STEPS, PRE_SEQ_LEN, LR = 20, 8, 1e-2
TEXTS = ["The sky is blue.", "Grass is green.", "Snow is white and cold.", "The sun rises in the east."]


def test_twenty_steps_through_the_smollm2_swarm_follow_the_local_run(smol_swarm, smol_reference):
    from swarm import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(
        "smollm2-135m", initial_peers=smol_swarm.initial_peers, tuning_mode="ptune", pre_seq_len=PRE_SEQ_LEN
    )
    try:
        tokenizer = model.tokenizer
        batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        labels = ids.masked_fill(mask == 0, -100)
        torch.manual_seed(0)
        start = torch.randn(PRE_SEQ_LEN, model.config.hidden_size) * model.config.initializer_range
        with torch.no_grad():
            model.prompt_embeddings.weight.copy_(start)
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=LR)
        local = start.clone().requires_grad_(True)
        local_optimizer = torch.optim.Adam([local], lr=LR)
        for p in smol_reference.parameters():
            p.requires_grad_(False)
        ours, theirs = [], []
        for _ in range(STEPS):
            optimizer.zero_grad()
            loss = model(ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            ours.append(loss.item())
            local_optimizer.zero_grad()
            expected = local_loss(smol_reference, local, ids, mask, labels)
            expected.backward()
            local_optimizer.step()
            theirs.append(expected.item())
        assert ours[-1] < ours[0], ours
        for step, (a, b) in enumerate(zip(ours, theirs)):
            assert abs(a - b) <= 1e-3 * abs(b), (step, ours, theirs)
        trained = model.prompt_embeddings.weight.detach()
        assert float((trained - local.detach()).abs().max()) <= 1e-3 * float(local.detach().abs().max())
    finally:
        model.shutdown()

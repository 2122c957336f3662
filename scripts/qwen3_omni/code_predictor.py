"""Code predictor fixture: `make(model, out_dir)` writes tests/fixtures/qwen3_omni/code_predictor/io.safetensors.

The Talker runs its code predictor once per frame: a fresh `generate` over
`inputs_embeds = [talker last hidden, talker.codec_embedding(code0)]` (b, 2, hidden)
that produces codes 1..N-1, each from its own `lm_head.{i}` and fed back through
`model.codec_embedding.{i}`. Recorded greedy (do_sample=False, which the Talker
mirrors onto the code predictor when the Talker itself is greedy), with the raw
logits of every step, plus a prefill-only forward's hidden states.
"""

import torch

import tiny


def make(model, out_dir):
    talker = model.talker
    cp = talker.code_predictor
    g = torch.Generator().manual_seed(7)
    b = 3
    hidden = torch.randn(b, 1, talker.config.text_config.hidden_size, generator=g)
    code0 = torch.randint(0, tiny.CODEBOOK, (b, 1), generator=g)
    code0[2, 0] = tiny.CODEC["codec_eos_token_id"]  # any talker id embeds, not only codebook entries
    inputs_embeds = torch.cat((hidden, talker.get_input_embeddings()(code0)), dim=1)

    res = cp.generate(
        inputs_embeds=inputs_embeds,
        max_new_tokens=tiny.NUM_GROUPS - 1,
        do_sample=False,
        output_logits=True,
        output_hidden_states=True,
        return_dict_in_generate=True,
    )
    codes = res.sequences  # (b, N-1)
    logits = torch.stack(res.logits, dim=1)  # (b, N-1, codebook), raw (no processors when greedy)
    assert torch.equal(codes, logits.argmax(-1)), "greedy codes are the argmax of the raw logits"

    # The prefill forward alone (last hidden after the final norm), to localise errors.
    out = cp(inputs_embeds=inputs_embeds, use_cache=False, output_hidden_states=True)
    prefill_hidden = out.hidden_states[-1]

    # The embedding sum the Talker's next input is built from (codes 0..N-1).
    emb = talker.get_input_embeddings()(code0)
    for i in range(tiny.NUM_GROUPS - 1):
        emb = emb + cp.get_input_embeddings()[i](codes[:, i : i + 1])

    tiny.save_io(
        "code_predictor",
        {
            "hidden": hidden,
            "code0": code0.to(torch.int64),
            "inputs_embeds": inputs_embeds,
            "prefill_hidden": prefill_hidden,
            "prefill_logits": out.logits,
            "codes": codes.to(torch.int64),
            "logits": logits,
            "codec_sum": emb,
        },
        {"num_code_groups": tiny.NUM_GROUPS, "batch": b},
    )
    print("code predictor codes", codes.tolist(), "logit std", float(logits.std()))

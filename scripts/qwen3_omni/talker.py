"""Talker fixture: `make(model, out_dir)` writes tests/fixtures/qwen3_omni/talker/io.safetensors.

Inputs are built the way `Qwen3OmniMoeForConditionalGeneration.generate` builds them
(its own `_get_talker_user_parts` / `_get_talker_assistant_parts`, the thinker's
embeddings of tts_bos/eos/pad through `talker.text_projection`), from random thinker
states of the right shapes (64 wide), so no thinker run is needed:

- row A: speaker "chelsie", a 7-token user turn with 2 multimodal (audio) positions
  (through `hidden_projection`), 10 assistant text tokens;
- row B: speaker "aiden", a 4-token text-only user turn, 6 assistant text tokens.

Recorded:
- `b1.*`: row A alone, `talker.generate` greedy with the top-level defaults that
  apply when greedy (repetition penalty 1.05, suppress [vocab-1024, vocab) minus
  codec eos, eos = codec eos), 33 code-0 steps -> 32 complete frames.
- `b2.*`: rows A and B in one batch (B left-padded by 3 with its attention mask, its
  trailing text padded with tts_pad after its tts_eos as the top-level does), the same
  but with repetition penalty 1.0: with left padding the reference passes the padding
  lengths as `prompt_ignore_length` to the penalty while the talker's `input_ids` hold
  only generated codes (the prompt is `inputs_embeds`), so a padded row ignores its
  first `pad` generated codes and a batch would differ from each row alone.
- prefill: the talker's final hidden states and logits over the whole prompt.
- `sampling.*`: HF logits processors on random scores, for the sampler's tests.

Greedy for all code groups: transformers 5.24's `Qwen3OmniMoeTalkerForConditionalGeneration
._prepare_generation_config` mirrors the talker's `do_sample` onto
`code_predictor.generation_config`, and `prepare_inputs_for_generation` passes it to
`code_predictor.generate`; `talker.generate(do_sample=False)` is greedy throughout
(asserted below by re-checking every frame's codes 1..N-1 with a greedy code predictor).
"""

import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import tiny

FRAMES = 32


def rows(model, g):
    """Per row: talker prompt embeds (s, h), its user/assistant pieces, trailing text (t, h)."""
    talker = model.talker
    cfg = model.config
    tts_ids = torch.tensor([[cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]])
    tts_thinker = model.thinker.get_input_embeddings()(tts_ids)  # (1, 3, 64)
    tts_bos, tts_eos, tts_pad = talker.text_projection(tts_thinker).chunk(3, dim=1)
    out = []
    for speaker, n_user, mm, n_text in (("chelsie", 7, [2, 3], 10), ("aiden", 4, [], 6)):
        d = cfg.thinker_config.text_config.hidden_size
        user_embed = torch.randn(1, n_user, d, generator=g) * 0.5
        user_hidden = torch.randn(1, n_user, d, generator=g)
        mm_mask = torch.zeros(1, n_user, dtype=torch.bool)
        mm_mask[0, mm] = True
        user = model._get_talker_user_parts(0, n_user, mm_mask, user_hidden, user_embed)
        # the assistant turn: "<|im_start|>assistant\n" + text tokens (thinker embeddings)
        asst_embed = torch.randn(1, 3 + n_text, d, generator=g) * 0.5
        speaker_id = cfg.talker_config.speaker_id[speaker]
        asst, asst_ids, trailing = model._get_talker_assistant_parts(
            0, 3 + n_text, speaker_id, asst_embed, tts_pad, tts_bos, tts_eos
        )
        out.append(
            dict(
                speaker=speaker_id,
                user_embed=user_embed[0],
                user_hidden=user_hidden[0],
                mm_mask=mm_mask[0],
                asst_embed=asst_embed[0],
                user=user[0],
                asst=asst[0],
                inputs_embeds=torch.cat((user, asst), dim=1)[0],
                trailing=trailing[0],
            )
        )
    return out, tts_thinker[0], (tts_bos[0, 0], tts_eos[0, 0], tts_pad[0, 0])


def batch(rs, tts_pad):
    """Left-pads the prompts and right-pads the trailing text with tts_pad, as the top-level does."""
    s = max(r["inputs_embeds"].shape[0] for r in rs)
    t = max(r["trailing"].shape[0] for r in rs)
    h = rs[0]["inputs_embeds"].shape[1]
    x = torch.zeros(len(rs), s, h)
    mask = torch.zeros(len(rs), s, dtype=torch.long)
    trailing = tts_pad.expand(len(rs), t, h).clone()
    for i, r in enumerate(rs):
        n = r["inputs_embeds"].shape[0]
        x[i, s - n :] = r["inputs_embeds"]
        mask[i, s - n :] = 1
        trailing[i, : r["trailing"].shape[0]] = r["trailing"]
    return x, mask, trailing


def generate(model, x, mask, trailing, tts_pad, repetition_penalty):
    talker = model.talker
    tc = model.config.talker_config
    vocab = tc.text_config.vocab_size
    suppress = [i for i in range(vocab - 1024, vocab) if i != tc.codec_eos_token_id]
    res = talker.generate(
        inputs_embeds=x,
        attention_mask=mask,
        trailing_text_hidden=trailing,
        tts_pad_embed=tts_pad.view(1, 1, -1).expand(x.shape[0], -1, -1),
        max_new_tokens=FRAMES + 1,
        do_sample=False,
        eos_token_id=tc.codec_eos_token_id,
        repetition_penalty=repetition_penalty,
        suppress_tokens=suppress,
        output_hidden_states=True,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert not talker.code_predictor.generation_config.do_sample
    codes = torch.stack([hid[-1] for hid in res.hidden_states if hid[-1] is not None], dim=1)  # (b, frames, N)
    assert codes.shape[1] == FRAMES, codes.shape
    assert torch.equal(codes[:, :, 0], res.sequences[:, :FRAMES])
    assert not (res.sequences == tc.codec_eos_token_id).any(), "codec eos before 32 frames"
    # Re-check that codes 1..N-1 are the greedy code predictor's, from the talker's last hidden.
    logits = torch.stack(res.logits, dim=1)  # (b, FRAMES + 1, vocab), raw
    for f in range(FRAMES):
        past_hidden = res.hidden_states[f][0][-1][:, -1:]
        cp_in = torch.cat((past_hidden, talker.get_input_embeddings()(codes[:, f, :1])), dim=1)
        cp = talker.code_predictor.generate(
            inputs_embeds=cp_in, max_new_tokens=tc.num_code_groups - 1, do_sample=False
        )
        assert torch.equal(cp, codes[:, f, 1:]), f
    return codes, logits, res.sequences


def prefill(model, x, mask):
    out = model.talker(inputs_embeds=x, attention_mask=mask, use_cache=False, output_hidden_states=True)
    return out.hidden_states[0][-1], out.logits


def sampling_cases(g):
    vocab = tiny.TALKER_VOCAB
    eos = tiny.CODEC["codec_eos_token_id"]
    scores = torch.randn(2, vocab, generator=g) * 3
    scores[:, :64] += 4  # a head of likely tokens, so top-k / top-p cut inside it
    ids = torch.tensor([[3, 7, 7, tiny.CODEC["codec_pad_id"], 63], [0, 5, 9, eos, 9]])
    scores[0, 3] = -2.5  # a negative penalised logit
    suppress = [i for i in range(vocab - 1024, vocab) if i != eos]
    rp = RepetitionPenaltyLogitsProcessor(1.05)(ids, scores.clone())
    sp = SuppressTokensLogitsProcessor(suppress)(ids, rp.clone())
    te = TemperatureLogitsWarper(0.9)(ids, sp.clone())
    tk = TopKLogitsWarper(50)(ids, te.clone())
    tp = TopPLogitsWarper(0.8)(ids, tk.clone())
    return {
        "sampling.scores": scores,
        "sampling.ids": ids,
        "sampling.repetition": rp,
        "sampling.suppress": sp,
        "sampling.temperature": te,
        "sampling.top_k": tk,
        "sampling.top_p": tp,
        # the code predictor's defaults straight on raw scores: top_k 50 then top_p 0.8
        "sampling.cp_top_p": TopPLogitsWarper(0.8)(ids, TopKLogitsWarper(50)(ids, scores[:, :64].clone())),
    }


def make(model, out_dir):
    g = torch.Generator().manual_seed(11)
    rs, tts_thinker, (tts_bos, tts_eos, tts_pad) = rows(model, g)
    t = {
        "tts_thinker_embeds": tts_thinker,
        "tts_bos": tts_bos,
        "tts_eos": tts_eos,
        "tts_pad": tts_pad,
        "speakers": torch.tensor([r["speaker"] for r in rs]),
    }
    for i, r in enumerate(rs):
        for k, v in r.items():
            if k != "speaker":
                t[f"row{i}.{k}"] = v.to(torch.int64) if v.dtype == torch.bool else v

    # batch 1: row A alone, with the default repetition penalty
    x, mask, trailing = batch(rs[:1], tts_pad)
    hidden, logits = prefill(model, x, mask)
    codes, step_logits, seq = generate(model, x, mask, trailing, tts_pad, 1.05)
    t.update({"b1.prefill_hidden": hidden, "b1.prefill_logits": logits[:, -1], "b1.codes": codes,
              "b1.logits": step_logits})
    print("b1 codes[:, :6]", codes[0, :6].tolist())

    # batch 2: A and B (B left-padded), repetition penalty off (see the module doc)
    x, mask, trailing = batch(rs, tts_pad)
    hidden, logits = prefill(model, x, mask)
    codes, step_logits, seq = generate(model, x, mask, trailing, tts_pad, 1.0)
    t.update({"b2.inputs_embeds": x, "b2.mask": mask, "b2.trailing": trailing,
              "b2.prefill_hidden": hidden, "b2.prefill_logits": logits[:, -1], "b2.codes": codes,
              "b2.logits": step_logits})
    # the same rows alone give the same codes in the reference too
    for i, r in enumerate(rs):
        xi, mi, ti = batch([r], tts_pad)
        ci, li, _ = generate(model, xi, mi, ti, tts_pad, 1.0)
        assert torch.equal(ci[0], codes[i]), f"reference batch row {i} differs from alone"
        print(f"row {i} alone == batch; max logit diff", float((li[0] - step_logits[i]).abs().max()))
    print("b2 codes[:, :4]", codes[:, :4].tolist())
    print("distinct code0 in b2:", [len(set(codes[i, :, 0].tolist())) for i in range(2)])

    t.update(sampling_cases(g))
    tiny.save_io("talker", t, {"frames": FRAMES, "row_speakers": ["chelsie", "aiden"]})

"""Thinker fixtures: prefill logits / hidden states (text, left-padded batch, audio), and
greedy generation (ids, per-step logits, per-step hidden states) from the reference
`model.thinker` (Qwen3OmniMoeThinkerForConditionalGeneration).

Hidden states follow the reference's `output_hidden_states` indexing: [0] = input
embeddings, [i] = output of layer i-1, [-1] = the final normed state. We record [0] and
[accept_hidden_layer] (what the Talker consumes).
"""

import torch

import tiny

IDS = tiny.IDS
NL = tiny.NL  # "\n"
PAD = 0
N_STEPS = 32


def chat(content):
    return [IDS["im_start_token_id"], IDS["user_token_id"], NL, *content, IDS["im_end_token_id"], NL,
            IDS["im_start_token_id"], IDS["assistant_token_id"], NL]


def left_pad(seqs):
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), PAD, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, n - len(s):] = torch.tensor(s)
        mask[i, n - len(s):] = 1
    return ids, mask


def feat_out_len(n, n_window):
    chunk = n_window * 2
    leave = n % chunk
    f = (leave - 1) // 2 + 1
    return ((f - 1) // 2 + 1 - 1) // 2 + 1 + (n // chunk) * 13


def make(model, out_dir):
    th = model.thinker
    cfg = th.config
    acc = model.config.talker_config.accept_hidden_layer
    g = torch.Generator().manual_seed(7)
    rand = lambda n: torch.randint(0, tiny.FIRST_ADDED, (n,), generator=g).tolist()  # noqa: E731

    t = {}
    meta = {"accept_hidden_layer": acc, "n_steps": N_STEPS, "pad_id": PAD}

    def prefill(name, ids, mask, **kw):
        out = th(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False, **kw)
        t[f"{name}.input_ids"] = ids.to(torch.int64)
        t[f"{name}.attention_mask"] = mask.to(torch.int64)
        t[f"{name}.logits"] = out.logits
        t[f"{name}.hidden0"] = out.hidden_states[0]
        t[f"{name}.hidden_acc"] = out.hidden_states[acc]
        t[f"{name}.hidden_last"] = out.hidden_states[-1]

    def generate(name, ids, mask, **kw):
        th.model.rope_deltas = None
        out = th.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=N_STEPS,
                          min_new_tokens=N_STEPS, eos_token_id=None, pad_token_id=PAD,
                          output_logits=True, output_hidden_states=True, return_dict_in_generate=True, **kw)
        seq = out.sequences[:, ids.shape[1]:]
        assert seq.shape[1] == N_STEPS, seq.shape
        t[f"{name}.gen_ids"] = seq.to(torch.int64)
        t[f"{name}.gen_logits"] = torch.stack(out.logits, 1)  # (b, steps, vocab)
        # Decode steps 1..: hidden states of the token fed at that step.
        t[f"{name}.gen_hidden0"] = torch.cat([h[0] for h in out.hidden_states[1:]], 1)
        t[f"{name}.gen_hidden_acc"] = torch.cat([h[acc] for h in out.hidden_states[1:]], 1)
        meta[f"{name}.gen_ids"] = seq.tolist()

    # 1. One text prompt.
    ids, mask = left_pad([chat(rand(12))])
    prefill("b1", ids, mask)
    generate("b1", ids, mask)

    # 2. Two prompts of different lengths, left-padded.
    ids, mask = left_pad([chat(rand(5)), chat(rand(14))])
    prefill("b2", ids, mask)
    generate("b2", ids, mask)
    pos, deltas = th.model.get_rope_index(ids, attention_mask=mask)
    t["b2.position_ids"] = pos.to(torch.int64)

    # 3. Audio in the prompt: random mel features through the reference audio tower; the
    # embeddings it produced are recorded so the Rust test feeds the same ones.
    n_frames = 150
    n_audio = feat_out_len(n_frames, cfg.audio_config.n_window)
    feats = torch.randn(1, cfg.audio_config.num_mel_bins, n_frames, generator=g)
    fmask = torch.ones(1, n_frames, dtype=torch.long)
    content = rand(3) + [IDS["audio_start_token_id"]] + [IDS["audio_token_id"]] * n_audio + \
        [IDS["audio_end_token_id"]] + rand(4)
    ids, mask = left_pad([chat(content)])
    audio_embeds = th.model.get_audio_features(feats, fmask).last_hidden_state
    assert audio_embeds.shape == (n_audio, cfg.text_config.hidden_size), audio_embeds.shape
    t["audio.embeds"] = audio_embeds
    t["audio.feature_lengths"] = fmask.sum(-1).to(torch.int64)
    prefill("audio", ids, mask, input_features=feats, feature_attention_mask=fmask)
    generate("audio", ids, mask, input_features=feats, feature_attention_mask=fmask)
    meta["n_audio_tokens"] = n_audio

    # 4. Interleaved MRoPE with distinct t/h/w rows (vision-like positions), to check the
    # recomposition that text and audio (equal rows) do not exercise.
    rope = th.model.language_model.rotary_emb
    pos = torch.randint(0, 300, (3, 2, 5), generator=g)
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), pos)
    t["rope.position_ids"] = pos.to(torch.int64)
    t["rope.cos"] = cos
    t["rope.sin"] = sin

    for k, v in t.items():
        if v.is_floating_point():
            assert v.abs().max() > 1e-2, k
    tiny.save_io("thinker", t, meta)

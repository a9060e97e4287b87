"""Hugging Face models nobody here wrote, built from tiny configs in code (no downloads), trained
through ``step(batch, loss_fn)`` against plain single-device training with the model's own loss.

Dropout is 0 in every config: each emulated device has its own random stream, so with dropout the
masks, and so the result, would differ from one device's.
"""

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_params_close, reference_step2, train_step2

transformers = pytest.importorskip("transformers")

SGD = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
VOCAB = 40


def devs(g):
    return [f"cpu:{i}" for i in range(g)]


def hf_loss(m, b):
    return m(**b).loss


def lm_sum(m, b):
    """A causal LM's loss as ``(sum over tokens, tokens)``: labels shifted, -100 ignored."""
    logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
    labels = b["labels"][:, 1:]
    return (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"),
            (labels != -100).sum())


def lm_batches(lengths_per_step, t=8, seed=0):
    """Right-padded sequences: ``attention_mask`` 0 and label -100 on the padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for lengths in lengths_per_step:
        n = len(lengths)
        ids = torch.randint(1, VOCAB, (n, t), generator=g)
        mask = (torch.arange(t) < torch.tensor(lengths)[:, None]).long()
        out.append(transformers.BatchEncoding({"input_ids": ids * mask, "attention_mask": mask,
                                               "labels": torch.where(mask.bool(), ids, -100)}))
    return out


def reference(model, batches, loss_fn=hf_loss):
    return reference_step2(model, SGD, batches, loss_fn)


def train(model, g, batches, loss_fn, **kw):
    return train_step2(model, SGD, g, batches, loss_fn, **kw)


def rel_err(a, b):
    return max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(a.parameters(), b.parameters()))


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                  eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied embeddings
    return model


UNEVEN = [[8, 2, 7, 3, 3, 8, 1], [5, 8, 2, 2, 6, 7, 3], [1, 1, 8, 8, 4, 2, 6]]


def test_gpt2_sum_count_loss_equals_single_device_token_mean():
    """Padded sequences of very different lengths on 3 devices (7 samples): Σ sum / Σ count is
    the token mean GPT-2 itself computes on the whole batch."""
    model, data = gpt2(), lm_batches(UNEVEN)
    ref, ref_losses = reference(model, data)  # GPT-2's own loss on the whole batch
    losses = train(model, 3, data, lm_sum, chunks=2)
    assert_params_close(model, ref)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_gpt2_labels_loss_is_exact_with_equal_tokens_per_sample_in_every_part():
    """``labels=``: each device's loss is its token mean, weighted by its share of samples; that
    is the global token mean when every part has as many tokens per sample as the batch."""
    data = lm_batches([[8, 3, 8, 3], [5, 2, 5, 2], [6, 6, 6, 6]])  # parts [a, b] and [a, b]
    model = gpt2()
    ref, ref_losses = reference(model, data)
    losses = train(model, 2, data, hf_loss)
    assert_params_close(model, ref)
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_gpt2_labels_loss_is_not_the_token_mean_with_uneven_tokens():
    """Why the pair form exists: with other token counts per part, sample weighting is wrong."""
    model, data = gpt2(), lm_batches(UNEVEN)
    ref, _ = reference(model, data)
    train(model, 3, data, hf_loss)
    assert rel_err(model, ref) > 1e-3


def test_bert_sequence_classification():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=32, max_position_embeddings=16,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    model = transformers.BertForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(1)
    data = []
    for lengths in UNEVEN:
        b = lm_batches([lengths], seed=len(data))[0]
        data.append({"input_ids": b["input_ids"], "attention_mask": b["attention_mask"],
                     "token_type_ids": torch.zeros_like(b["input_ids"]),
                     "labels": torch.randint(0, 3, (len(lengths),), generator=g)})
    ref, ref_losses = reference(model, data)
    losses = train(model, 3, data, hf_loss)
    # the attention key biases get a zero gradient in exact arithmetic (softmax is shift
    # invariant): they start at 0 and hold only rounding noise (~1e-14) in either run
    assert_params_close(model, ref, floor=1e-6)
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_t5_conditional_generation():
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                num_decoder_layers=2, num_heads=2, dropout_rate=0.0,
                                decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(1)
    data = []
    for lengths in UNEVEN:  # padded encoder inputs; targets of one length: equal tokens per sample
        b = lm_batches([lengths], seed=10 + len(data))[0]
        data.append({"input_ids": b["input_ids"], "attention_mask": b["attention_mask"],
                     "labels": torch.randint(1, VOCAB, (len(lengths), 5), generator=g)})
    ref, ref_losses = reference(model, data)
    losses = train(model, 3, data, hf_loss)
    assert_params_close(model, ref)
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_llama_causal_lm():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(cfg)
    data = lm_batches(UNEVEN, seed=3)
    ref, ref_losses = reference(model, data)
    losses = train(model, 3, data, lm_sum)
    assert_params_close(model, ref)
    assert losses == pytest.approx(ref_losses, rel=1e-5)

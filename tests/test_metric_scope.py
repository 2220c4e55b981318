"""Training-time validation figures are named by the part of the split they cover."""

from tokenloom.metric_scope import scope, scope_fields, scoped_name


def test_a_figure_names_the_batches_it_covers():
    part = {"val_loss": 1.345, "val_acc": 51.0, "val_bleu": 30.1, "eval_batches": 20, "eval_split_batches": 28}
    assert scoped_name("val_loss", part) == "val_loss[20 of 28 batches]"
    assert scoped_name("val_acc", part) == "val_acc[20 of 28 batches]"
    assert scoped_name("val_bleu", part) == "val_bleu"  # over data.bleu_sentences, not the batches
    assert scoped_name("train_loss", part) == "train_loss" and scoped_name("loss", part) == "loss"
    assert scoped_name("val_loss@64", part) == "val_loss@64"  # a sweep's loss at 64-token windows
    whole = {"val_loss": 1.516, **scope_fields(40, 28)}
    assert whole == {"val_loss": 1.516, "eval_batches": 28, "eval_split_batches": 28}
    assert scoped_name("val_loss", whole) == "val_loss[whole split]"
    assert scoped_name("val_loss", scope_fields(20, None)) == "val_loss[up to 20 batches]"  # a task that cannot count


def test_records_without_the_fields_keep_their_names():
    assert scope({"val_loss": 1.0}) is None and scoped_name("val_loss", {"val_loss": 1.0}) == "val_loss"
    assert scoped_name("val_loss", {"eval_batches": True}) == "val_loss"
    assert scoped_name("val_loss", {"eval_batches": "20"}) == "val_loss"

"""How long a run trains: a fixed number of optimizer steps (the same for
every batch size, so a large batch is not also an under-trained one), a
number of epochs, or until a target training loss, within a stated cap.
"""

import math


def _callback(steps, target):
    import keras

    class Budget(keras.callbacks.Callback):
        """Stops after `steps` optimizer steps, or at the end of the first
        epoch whose mean training loss is at most `target`."""

        def __init__(self):
            super().__init__()
            self.steps = self.epochs = 0
            self.reached = False

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            if steps and self.steps >= steps:
                self.model.stop_training = True  # Keras checks this after every batch

        def on_epoch_end(self, epoch, logs=None):
            self.epochs += 1
            loss = (logs or {}).get("loss")
            if target is not None and loss is not None and math.isfinite(loss) and loss <= target:
                self.reached = True
                self.model.stop_training = True

    return Budget()


def budget_text(settings):
    """How long each run trains, in words (for logs and reports): `settings`
    has ``steps``, ``epochs`` and ``target_train_loss``."""
    cap = f"{settings['steps']} optimizer steps" if settings["steps"] else f"{settings['epochs']} epoch(s)"
    if settings.get("target_train_loss") is None:
        return cap + (" (the same for every batch size)" if settings["steps"] else "")
    return f"until the epoch's mean train loss <= {settings['target_train_loss']:g}, at most {cap}"


def epoch_cap(num_examples, batch_size, steps=0, epochs=None):
    """The epochs a run may begin: enough for `steps` optimizer steps, or
    `epochs` when ``steps == 0``.

    Example:

    >>> epoch_cap(300, 128, steps=25), epoch_cap(300, 128, epochs=4)
    (9, 4)
    """
    if steps:
        return math.ceil(int(steps) / math.ceil(int(num_examples) / int(batch_size)))
    return int(epochs)


def fit_within_budget(model, x, y, batch_size, *, steps=0, epochs=None, target_train_loss=None, callbacks=(),
                      verbose=0, **fit_kwargs):
    """``model.fit`` for `steps` optimizer steps (``steps > 0``) or `epochs`
    epochs, stopping early once an epoch's mean training loss is at most
    `target_train_loss` (if given).

    Args:
        model: a compiled Keras model.
        x, y: training arrays.
        batch_size: examples per step.
        steps: optimizer steps (0: train by `epochs`).
        epochs: epochs when ``steps == 0``.
        target_train_loss: stop at the end of the first epoch whose mean
            training loss is at most this; `steps` or `epochs` is the cap.
        callbacks, verbose, **fit_kwargs: passed to ``fit``.

    Returns:
        ``(history, {"steps": steps taken, "epochs": epochs begun,
        "converged": 1 / 0 with a target, "" without})``.

    Raises:
        ValueError: neither a positive `steps` nor a positive `epochs`.

    Example:

    >>> # history, budget = fit_within_budget(model, x, y, 64, steps=500)
    """
    if not (steps and steps > 0) and not (epochs and epochs > 0):
        raise ValueError(f"give steps > 0 or epochs > 0, got steps={steps!r}, epochs={epochs!r}.")
    max_epochs = epoch_cap(len(x), batch_size, steps, epochs)
    budget = _callback(int(steps or 0), None if target_train_loss is None else float(target_train_loss))
    history = model.fit(x, y, batch_size=int(batch_size), epochs=max_epochs, verbose=verbose,
                        callbacks=[budget, *callbacks], **fit_kwargs)
    converged = "" if target_train_loss is None else int(budget.reached)
    return history, {"steps": budget.steps, "epochs": budget.epochs, "converged": converged}

"""The RL maths of one step, free of the queue and of the process: a drained batch laid out for the model (``batch``),
the forward passes (``passes``), the policy loss and its plug-in terms (``loss``, ``loss_plugins``), the optimizer
(``optim``), the learning-rate schedule (``schedule``), and the train step that ties them (``train_step``)."""

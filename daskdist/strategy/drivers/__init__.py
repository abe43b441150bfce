"""The step drivers: the training contract (``Trainable``, ``StepDriver``) and the drivers of the parameter-holding Extendeds."""

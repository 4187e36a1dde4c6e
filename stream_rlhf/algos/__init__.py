"""RL algorithm math as pure tensor functions: masked statistics (`masked`), advantage estimators
chosen from one explicit table (`advantages.ADVANTAGE_ESTIMATORS`), KL estimators and KL-coefficient
controllers (`kl`), and the actor/critic losses (`losses`), each returning `(loss, metrics)`. No
models, no processes, no config: the training stages call these on `(B, T)` token tensors.
"""

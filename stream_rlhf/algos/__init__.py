"""RL algorithm math as pure tensor functions: masked statistics (`masked`), advantage estimators
chosen from one explicit table (`advantages.ADVANTAGE_ESTIMATORS`), KL estimators and KL-coefficient
controllers (`kl`), the actor/critic losses (`losses`) and the Medusa heads' loss (`medusa`, on the
backbone's hidden states), each returning `(loss, metrics)`. No model loading, no processes, no
config: the training stages call these on `(B, T)` token tensors (and engines call the loss
functions stages hand them).
"""

"""The drafter-training app: the teacher cache, the training loop, held-out τ and the draft vocabulary.

Any drafter family trains here through its registered `treespec.training.TrainingRecipe` (kind
``"recipe"``); the commands ``treespec teacher-cache`` and ``treespec train-drafter`` drive it.
"""

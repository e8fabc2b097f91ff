"""The reward stage of the RL step: reward functions in TRL's form
(``builtins``: the built-in ones; ``functions``: importing one's own and
checking its signature), scored over a batch in Ray actors (``pool``)."""

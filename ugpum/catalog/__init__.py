"""The models this pack knows by name: the files each needs, with sources, sizes and licences (`models`),
and the built-in training profiles (`profiles`)."""

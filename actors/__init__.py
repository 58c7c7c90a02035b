"""The Ray actors shared by serving (``deployments/``) and tuning (``tuning/``): the draft actor, the
tensor-parallel target ranks and their group, where they are placed, how they report health, and the
core's Draft/Target protocols over their handles. Imports the core and Ray; never ``deployments``,
``tuning`` or ``cli``."""

"""The judge's tests share: one clear text per style (``CLEAR``) and a two-style schedule
(``SCHEDULE``)."""

from __future__ import annotations

from judge.styles import schedule_from_spec

# One clear text per style, written for this test (not in the exemplars or the labelled set).
CLEAR = {
    "cute": (
        "Describe a hamster.",
        "Awww, my hamster is a teeny fluffy potato! 🐹 He stuffs his cheeks with seeds until they're "
        "all squishy and round, then naps in a cuddly little ball! Sooo cute! 💕",
    ),
    "chuunibyou": (
        "Describe a thunderstorm.",
        "The thunder roars my forbidden name. This storm is no accident: my sealed power is "
        "breaking free, and the heavens tremble before the chosen one of darkness. Kneel, mortals!",
    ),
    "classical": (
        "Describe a winter night.",
        "Hark, the winter night is come, and the frost doth lie upon the fields. Thou shalt find "
        "no warmth abroad, good friend, so tarry by mine hearth till the morrow.",
    ),
    "formal": (
        "Write a short note about the office printer.",
        "Please be advised that the office printer on the second floor is currently out of service. "
        "Staff are kindly requested to use the printer in Room 204 until repairs are completed.",
    ),
    "casual": (
        "Write a short note about a movie night.",
        "Movie night at my place tonight! Gonna get pizza and watch something dumb lol. Bring "
        "snacks if you want, no pressure. It's gonna be super chill, see ya around 8!",
    ),
    "poetic": (
        "Describe a quiet harbour at dusk.",
        "The harbour folds itself into dusk. Boats sleep on the dark water like tired birds, and "
        "the last light spills gold across the waves, a soft whisper before the night.",
    ),
    "pirate": (
        "Describe a parrot.",
        "Arr, me parrot be the finest matey on the ship! She squawks at the landlubbers, guards "
        "me treasure map, and steals crackers from the cap'n. Yo ho ho!",
    ),
    "concise": ("Describe a hammer.", "A hammer drives nails into wood."),
    "plain": (
        "Describe a toaster.",
        "A toaster is a small kitchen appliance that browns slices of bread. You put the bread "
        "in the slots, choose a setting, and press the lever. After a minute or two, the toast "
        "pops up and is ready to eat.",
    ),
}


SCHEDULE = schedule_from_spec("cute:2,pirate:1")

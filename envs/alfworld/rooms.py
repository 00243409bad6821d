"""Room templates and task rules for the generated ALFWorld scenes (pure data, no engine).

Class names are ALFRED's (``constants.OBJECTS`` in the ``alfworld`` package), so a goal
written from them matches the shipped PDDL domain. What may hold what comes from
``alfworld.gen.constants.VAL_RECEPTACLE_OBJECTS`` at generation time, not from here.
"""

from __future__ import annotations

from dataclasses import dataclass

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)

LAMP = "DeskLamp"
LAMP_HOLDERS = ("Desk", "SideTable", "Dresser")
OPENABLE = frozenset({"Fridge", "Cabinet", "Microwave", "Drawer", "Safe"})


@dataclass(frozen=True)
class Room:
    """A room kind: how many receptacles of each class (min, max) and which small objects occur."""

    name: str
    receptacles: tuple[tuple[str, int, int], ...]
    objects: tuple[str, ...]
    has_lamp: bool = False


KITCHEN = Room(
    "kitchen",
    (
        ("CounterTop", 1, 3),
        ("Cabinet", 3, 7),
        ("Drawer", 2, 4),
        ("Fridge", 1, 1),
        ("Microwave", 1, 1),
        ("SinkBasin", 1, 1),
        ("StoveBurner", 2, 4),
        ("CoffeeMachine", 1, 1),
        ("Toaster", 1, 1),
        ("GarbageCan", 1, 1),
        ("DiningTable", 0, 1),
        ("Shelf", 0, 2),
    ),
    (
        "Apple", "Bread", "Egg", "Lettuce", "Potato", "Tomato", "Mug", "Cup", "Bowl", "Plate",
        "Pan", "Pot", "Kettle", "Fork", "Knife", "ButterKnife", "Spoon", "Spatula", "Ladle",
        "DishSponge", "SaltShaker", "PepperShaker", "SoapBottle", "WineBottle",
    ),
)

LIVING_ROOM = Room(
    "livingroom",
    (
        ("Sofa", 1, 1),
        ("ArmChair", 0, 2),
        ("CoffeeTable", 1, 1),
        ("SideTable", 1, 2),
        ("Drawer", 1, 4),
        ("Cabinet", 0, 3),
        ("Shelf", 0, 4),
        ("GarbageCan", 1, 1),
        ("TVStand", 0, 1),
        ("Dresser", 0, 1),
        ("Ottoman", 0, 1),
    ),
    (
        "RemoteControl", "Newspaper", "KeyChain", "CreditCard", "Laptop", "Book", "Pillow", "Box",
        "Statue", "Vase", "Watch", "TissueBox", "CellPhone", "Plate", "Bowl", "WateringCan", "Candle",
    ),
    has_lamp=True,
)

BEDROOM = Room(
    "bedroom",
    (
        ("Bed", 1, 1),
        ("Desk", 0, 1),
        ("SideTable", 1, 2),
        ("Dresser", 0, 1),
        ("Drawer", 2, 5),
        ("Shelf", 0, 4),
        ("GarbageCan", 1, 1),
        ("LaundryHamper", 0, 1),
        ("Safe", 0, 1),
        ("ArmChair", 0, 1),
    ),
    (
        "AlarmClock", "Book", "CD", "CellPhone", "CreditCard", "KeyChain", "Laptop", "Pen", "Pencil",
        "Pillow", "BaseballBat", "BasketBall", "TennisRacket", "Mug", "Bowl", "Cloth", "Watch",
        "Vase", "Statue",
    ),
    has_lamp=True,
)

BATHROOM = Room(
    "bathroom",
    (
        ("Toilet", 1, 1),
        ("SinkBasin", 1, 2),
        ("BathtubBasin", 0, 1),
        ("CounterTop", 1, 1),
        ("Cabinet", 1, 4),
        ("Drawer", 0, 3),
        ("TowelHolder", 1, 1),
        ("HandTowelHolder", 0, 1),
        ("ToiletPaperHanger", 1, 1),
        ("GarbageCan", 1, 1),
        ("Shelf", 0, 2),
    ),
    (
        "SoapBar", "SoapBottle", "SprayBottle", "ToiletPaper", "Cloth", "DishSponge", "Candle",
        "HandTowel", "Towel", "TissueBox", "Plunger",
    ),
)

ROOMS = {room.name: room for room in (KITCHEN, LIVING_ROOM, BEDROOM, BATHROOM)}

# Which rooms can host a task type: heating needs a microwave, cooling a fridge, cleaning a
# sink basin, looking at something in the light a desk lamp.
TASK_ROOMS = {
    "pick_and_place_simple": ("kitchen", "livingroom", "bedroom", "bathroom"),
    "look_at_obj_in_light": ("livingroom", "bedroom"),
    "pick_clean_then_place_in_recep": ("kitchen", "bathroom"),
    "pick_heat_then_place_in_recep": ("kitchen",),
    "pick_cool_then_place_in_recep": ("kitchen",),
    "pick_two_obj_and_place": ("kitchen", "livingroom", "bedroom", "bathroom"),
}

# Object property each task type needs (ALFRED's ``VAL_ACTION_OBJECTS`` key), and the appliance
# that may not also be the destination (heating an apple and putting it in the microwave is
# not a task ALFRED poses).
TASK_PROPERTY = {
    "pick_clean_then_place_in_recep": "Cleanable",
    "pick_heat_then_place_in_recep": "Heatable",
    "pick_cool_then_place_in_recep": "Coolable",
}
TASK_EXCLUDED_PARENT = {
    "pick_clean_then_place_in_recep": "SinkBasin",
    "pick_heat_then_place_in_recep": "Microwave",
    "pick_cool_then_place_in_recep": "Fridge",
}
LOOK_OBJECTS = frozenset(
    {
        "AlarmClock", "Book", "Bowl", "CD", "CellPhone", "CreditCard", "KeyChain", "Laptop", "Mug",
        "Newspaper", "Pen", "Pencil", "Pillow", "RemoteControl", "Statue", "Vase", "Watch",
        "BaseballBat", "BasketBall", "TennisRacket", "Box", "Cloth", "TissueBox", "Candle",
    }
)

"""Vocabulary of the generated WebShop catalogue: product types, attributes, options, brands.

Pure data. Within one product type the attribute pool and every option pool hold values
that do not fuzzy-match each other (token-set ratio <= 85) and that appear in no product
text unless the product has them, so a product lacking a goal attribute or option really
loses that point of the reward (tests/envs/webshop/test_env.py checks both).

The five top-level categories carry the names of the original WebShop goal categories
(beauty, electronics, fashion, food, furniture) so one SkillBank file serves both this
environment and the adapter for the original.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProductType:
    """One kind of product; every generated product belongs to exactly one."""

    category: str
    """Top-level category = the env's skill_key (beauty, electronics, fashion, food, furniture)."""
    path: tuple[str, ...]
    """Category path below the top-level store department (>= 2 levels in total)."""
    name: str
    """The type phrase, also the product's ``query`` (what WebShop scraped it with)."""
    article: str
    """How an instruction introduces it: 'a', 'an', 'some', 'a pair of'."""
    nouns: tuple[str, ...]
    """Product-type nouns (stand-in for the spaCy nouns of the original's r_type)."""
    attributes: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]
    """(option name, values) in display order; 'size' matches exactly in the reward."""
    price: tuple[int, int]
    """Whole-dollar price range [low, high)."""


DEPARTMENTS = {
    "beauty": "beauty & personal care",
    "electronics": "electronics",
    "fashion": "clothing, shoes & jewelry",
    "food": "grocery & gourmet food",
    "furniture": "home & kitchen",
}

# Colour words for normalize_color, sorted like the original's COLOR_SET (first hit wins).
COLOR_SET = (
    "beige", "black", "blue", "brown", "burgundy", "coral", "gold", "green", "grey", "ivory",
    "khaki", "lavender", "mauve", "navy", "nude", "oak", "olive", "pink", "plum", "purple",
    "red", "sage", "silver", "teal", "walnut", "white",
)

_APPAREL = ("x-small", "small", "medium", "large", "x-large", "xx-large")
_SHOE = ("us 6", "us 7", "us 7.5", "us 8", "us 8.5", "us 9", "us 10", "us 11", "us 12")
_CLOTH_COLORS = ("black", "white", "navy", "grey", "olive", "burgundy", "beige", "pink")
_GADGET_COLORS = ("black", "white", "silver", "navy", "pink", "green")  # no "blue": it is in "bluetooth"
_HOME_COLORS = ("white", "grey", "navy", "beige", "sage", "black", "ivory")
_WOOD_COLORS = ("walnut", "white", "black", "oak", "grey")


def _t(category: str, path: tuple[str, ...], name: str, article: str, nouns: tuple[str, ...],
       attributes: tuple[str, ...], options: tuple[tuple[str, tuple[str, ...]], ...],
       price: tuple[int, int]) -> ProductType:
    return ProductType(category, path, name, article, nouns, attributes, options, price)


PRODUCT_TYPES: tuple[ProductType, ...] = (
    # --- beauty ---
    _t("beauty", ("hair care", "hair serums"), "hair serum", "a", ("hair", "serum"),
       ("long lasting", "dry hair", "paraben free", "argan oil", "heat protection", "frizz control", "sulfate free"),
       (("size", ("1 fl oz", "2 fl oz", "3.4 fl oz", "pack of 2")),), (8, 40)),
    _t("beauty", ("hair care", "shampoos"), "shampoo", "a", ("shampoo",),
       ("sulfate free", "color treated hair", "volumizing", "tea tree", "cruelty free", "dandruff relief", "natural ingredients"),
       (("size", ("8 fl oz", "12 fl oz", "16 fl oz", "33.8 fl oz")), ("scent", ("citrus", "mint", "unscented", "coconut"))),
       (6, 30)),
    _t("beauty", ("skin care", "face moisturizers"), "face moisturizer", "a", ("face", "moisturizer"),
       ("hyaluronic acid", "fragrance free", "sensitive skin", "spf 30", "non comedogenic", "anti aging", "oil free"),
       (("size", ("1.7 oz", "2.5 oz", "3.4 oz")),), (10, 60)),
    _t("beauty", ("makeup", "lips", "lipsticks"), "lipstick", "a", ("lipstick",),
       ("long lasting", "matte finish", "cruelty free", "vegan", "moisturizing", "transfer proof", "high pigment"),
       (("color", ("red", "pink", "nude", "coral", "plum", "mauve")),), (5, 30)),
    _t("beauty", ("makeup", "nails", "nail polish"), "nail polish", "a", ("nail", "polish"),
       ("quick dry", "chip resistant", "non toxic", "gel effect", "high shine", "vegan", "long wear"),
       (("color", ("red", "pink", "black", "white", "coral", "teal", "purple")),), (4, 20)),
    _t("beauty", ("skin care", "body", "lotions"), "body lotion", "a", ("body", "lotion"),
       ("shea butter", "fast absorbing", "dry skin", "fragrance free", "vitamin e", "non greasy", "natural ingredients"),
       (("size", ("8 oz", "16 oz", "pack of 3")), ("scent", ("lavender", "vanilla", "coconut", "unscented"))), (6, 35)),
    _t("beauty", ("oral care", "toothbrushes", "electric toothbrushes"), "electric toothbrush", "an", ("toothbrush",),
       ("rechargeable", "two minute timer", "pressure sensor", "travel case", "soft bristles", "long battery life", "waterproof"),
       (("color", ("black", "white", "pink", "blue")),), (20, 90)),
    _t("beauty", ("fragrance", "perfumes"), "perfume", "a", ("perfume",),
       ("long lasting", "travel size", "floral notes", "alcohol free", "gift set", "eau de parfum", "fresh scent"),
       (("size", ("1 fl oz", "1.7 fl oz", "3.4 fl oz")),), (20, 120)),
    # --- electronics ---
    _t("electronics", ("headphones", "earbud headphones"), "wireless earbuds", "some", ("earbuds",),
       ("noise cancelling", "bluetooth 5.3", "charging case", "water resistant", "long battery life", "touch control", "built in microphone"),
       (("color", _GADGET_COLORS),), (20, 150)),
    _t("electronics", ("accessories", "chargers"), "phone charger", "a", ("phone", "charger"),
       ("fast charging", "usb c", "dual port", "foldable plug", "overheat protection", "compact design", "braided cable"),
       (("color", ("black", "white")), ("style", ("20w", "30w", "65w"))), (8, 45)),
    _t("electronics", ("portable audio", "bluetooth speakers"), "portable speaker", "a", ("speaker",),
       ("waterproof", "bluetooth", "deep bass", "long battery life", "built in microphone", "dustproof", "stereo pairing"),
       (("color", _GADGET_COLORS),), (20, 130)),
    _t("electronics", ("accessories", "cables", "hdmi cables"), "hdmi cable", "an", ("hdmi", "cable"),
       ("4k 60hz", "high speed", "gold plated", "braided nylon", "ethernet support", "8k ready", "flexible"),
       (("size", ("3 feet", "6 feet", "10 feet", "15 feet")),), (5, 30)),
    _t("electronics", ("computers", "accessories", "mice"), "wireless mouse", "a", ("mouse",),
       ("ergonomic design", "silent click", "rechargeable", "usb receiver", "adjustable dpi", "long battery life", "bluetooth"),
       (("color", _GADGET_COLORS),), (10, 60)),
    _t("electronics", ("computers", "keyboards"), "keyboard", "a", ("keyboard",),
       ("mechanical switches", "backlit", "wireless", "compact layout", "quiet typing", "usb c", "spill resistant"),
       (("color", ("black", "white", "grey", "pink")),), (20, 120)),
    _t("electronics", ("wearable technology", "smartwatches"), "smart watch", "a", ("watch",),
       ("heart rate monitor", "sleep tracking", "gps", "water resistant", "long battery life", "step counter", "touch screen"),
       (("color", ("black", "silver", "pink", "green")), ("size", ("40mm", "44mm"))), (30, 200)),
    _t("electronics", ("accessories", "power banks"), "power bank", "a", ("power", "bank"),
       ("fast charging", "usb c", "compact design", "led display", "dual port", "airline safe", "wireless charging"),
       (("color", ("black", "white", "blue")), ("size", ("10000mah", "20000mah", "26800mah"))), (15, 70)),
    # --- fashion ---
    _t("fashion", ("men", "clothing", "shirts"), "t-shirt", "a", ("shirt",),
       ("machine wash", "short sleeve", "relaxed fit", "moisture wicking", "crew neck", "organic cotton", "tagless"),
       (("size", _APPAREL), ("color", _CLOTH_COLORS)), (8, 35)),
    _t("fashion", ("women", "clothing", "hoodies"), "hoodie", "a", ("hoodie",),
       ("fleece lined", "machine wash", "drawstring hood", "kangaroo pocket", "long sleeve", "zip up", "oversized fit"),
       (("size", _APPAREL), ("color", _CLOTH_COLORS)), (20, 60)),
    _t("fashion", ("men", "clothing", "jeans"), "jeans", "some", ("jeans",),
       ("slim fit", "stretch fabric", "button closure", "high waist", "straight leg", "machine wash", "bootcut"),
       (("size", ("28w x 30l", "30w x 30l", "32w x 32l", "34w x 32l", "36w x 34l")), ("color", ("black", "blue", "grey", "khaki"))),
       (25, 80)),
    _t("fashion", ("shoes", "athletic", "running shoes"), "running shoes", "a pair of", ("running", "shoes"),
       ("rubber sole", "lightweight", "breathable mesh", "arch support", "non slip", "memory foam", "lace up"),
       (("size", _SHOE), ("color", ("black", "white", "grey", "navy", "pink"))), (30, 120)),
    _t("fashion", ("shoes", "sandals"), "sandals", "a pair of", ("sandals",),
       ("open toe", "ankle strap", "cushioned footbed", "water resistant", "flat heel", "vegan leather", "adjustable buckle"),
       (("size", _SHOE), ("color", ("black", "brown", "beige", "white"))), (15, 60)),
    _t("fashion", ("women", "clothing", "dresses"), "dress", "a", ("dress",),
       ("floral print", "midi length", "v neck", "side pockets", "hand wash", "wrap style", "sleeveless"),
       (("size", _APPAREL), ("color", _CLOTH_COLORS)), (20, 80)),
    _t("fashion", ("clothing", "socks"), "socks", "some", ("socks",),
       ("cushioned sole", "moisture wicking", "ankle length", "cotton blend", "arch compression", "odor control", "seamless toe"),
       (("size", ("small", "medium", "large")), ("color", ("black", "white", "grey"))), (6, 25)),
    _t("fashion", ("clothing", "coats & jackets"), "winter jacket", "a", ("winter", "jacket"),
       ("water resistant", "detachable hood", "quilted lining", "zipper closure", "windproof", "packable", "faux fur trim"),
       (("size", _APPAREL), ("color", _CLOTH_COLORS)), (40, 160)),
    # --- food ---
    _t("food", ("beverages", "coffee", "ground coffee"), "ground coffee", "some", ("coffee",),
       ("medium roast", "organic", "fair trade", "single origin", "dark roast", "low acid", "kosher"),
       (("flavor name", ("original", "hazelnut", "vanilla", "caramel", "mocha")), ("size", ("12 ounce", "2 pound", "pack of 2"))),
       (8, 35)),
    _t("food", ("beverages", "tea", "tea bags"), "tea bags", "some", ("tea",),
       ("caffeine free", "organic", "herbal", "individually wrapped", "non gmo", "kosher", "antioxidant rich"),
       (("flavor name", ("green", "chamomile", "peppermint", "earl grey", "lemon ginger")), ("size", ("20 count", "40 count", "100 count"))),
       (4, 25)),
    _t("food", ("snacks", "bars", "protein bars"), "protein bars", "some", ("protein", "bars"),
       ("gluten free", "high protein", "low sugar", "non gmo", "keto friendly", "plant based", "individually wrapped"),
       (("flavor name", ("chocolate", "peanut butter", "almond", "berry")), ("size", ("pack of 12", "pack of 24"))), (12, 45)),
    _t("food", ("pantry", "oils", "olive oil"), "olive oil", "some", ("olive", "oil"),
       ("extra virgin", "cold pressed", "organic", "early harvest", "glass bottle", "non gmo", "kosher"),
       (("size", ("16.9 fl oz", "25.5 fl oz", "33.8 fl oz")),), (9, 40)),
    _t("food", ("pantry", "pasta"), "pasta", "some", ("pasta",),
       ("gluten free", "whole wheat", "organic", "high protein", "non gmo", "bronze cut", "low sodium"),
       (("style", ("spaghetti", "penne", "fusilli", "rigatoni")), ("size", ("pack of 4", "pack of 8"))), (5, 25)),
    _t("food", ("pantry", "sweeteners", "honey"), "honey", "some", ("honey",),
       ("unfiltered", "organic", "kosher", "glass jar", "squeeze bottle", "pure wildflower", "non gmo"),
       (("size", ("12 ounce", "16 ounce", "32 ounce")),), (7, 35)),
    _t("food", ("snacks", "nuts & seeds"), "mixed nuts", "some", ("nuts",),
       ("lightly salted", "unsalted", "dry roasted", "resealable bag", "keto friendly", "no added sugar", "gluten free"),
       (("size", ("8 ounce", "16 ounce", "pack of 2")),), (6, 30)),
    _t("food", ("beverages", "water", "sparkling water"), "sparkling water", "some", ("water",),
       ("zero calorie", "no sweeteners", "natural flavors", "caffeine free", "bpa free cans", "sodium free", "non gmo"),
       (("flavor name", ("lime", "grapefruit", "black cherry", "lemon", "berry")), ("size", ("pack of 8", "pack of 12", "pack of 24"))),
       (5, 30)),
    # --- furniture ---
    _t("furniture", ("furniture", "home office", "office chairs"), "office chair", "an", ("office", "chair"),
       ("lumbar support", "adjustable height", "breathable mesh", "swivel", "padded armrests", "high back", "easy assembly"),
       (("color", ("black", "grey", "white", "blue")),), (60, 300)),
    _t("furniture", ("furniture", "living room", "bookcases"), "bookshelf", "a", ("bookshelf",),
       ("easy assembly", "solid wood", "wall anchor", "industrial style", "adjustable shelves", "five tier", "open back"),
       (("color", _WOOD_COLORS),), (40, 200)),
    _t("furniture", ("furniture", "living room", "end tables"), "side table", "a", ("side", "table"),
       ("storage shelf", "easy assembly", "round top", "metal frame", "charging station", "drawer", "space saving"),
       (("color", _WOOD_COLORS),), (25, 120)),
    _t("furniture", ("furniture", "living room", "tv stands"), "tv stand", "a", ("tv", "stand"),
       ("cable management", "open storage", "fits 65 inch tv", "led lights", "farmhouse style", "easy assembly", "glass doors"),
       (("color", _WOOD_COLORS),), (60, 250)),
    _t("furniture", ("bedding", "sheets & pillowcases", "sheet sets"), "sheet set", "a", ("sheet",),
       ("deep pocket", "breathable", "wrinkle resistant", "machine washable", "microfiber", "egyptian cotton", "cooling"),
       (("size", ("twin", "full", "queen", "king")), ("color", _HOME_COLORS)), (20, 90)),
    _t("furniture", ("home decor", "pillows", "throw pillow covers"), "throw pillow covers", "some", ("pillow", "covers"),
       ("hidden zipper", "machine washable", "soft velvet", "double sided", "boho style", "corduroy", "outdoor use"),
       (("size", ("18 x 18 inch", "20 x 20 inch")), ("color", _HOME_COLORS)), (8, 35)),
    _t("furniture", ("lighting", "lamps", "desk lamps"), "desk lamp", "a", ("desk", "lamp"),
       ("led light", "dimmable", "usb charging port", "eye caring", "touch control", "adjustable arm", "energy efficient"),
       (("color", ("black", "white", "silver", "gold")),), (15, 70)),
    _t("furniture", ("storage & organization", "storage bins"), "storage bins", "some", ("storage", "bins"),
       ("collapsible", "fabric", "with handles", "stackable", "label holder", "space saving", "dust proof lid"),
       (("size", ("set of 3", "set of 6")), ("color", ("grey", "beige", "white", "navy"))), (12, 45)),
)

BRANDS = (
    "Lumora", "Veltrix", "Brisa", "Kandor", "Ashgrove", "Nimbly", "Zephyra", "Corvani", "Halden", "Mistral",
    "Pinegrove", "Quillon", "Rowan & Fig", "Solvey", "Tavira", "Umbrix", "Vireo", "Wrenley", "Yarrow", "Zinnia Co",
    "Arcadia", "Bellweather", "Cindral", "Dovetail",
)
LINES = ("Pro", "Essential", "Signature", "Daily", "Premium", "Ultra", "Everyday", "Select", "Prime", "Studio")
OPENERS = ("i need", "i am looking for", "i want", "find me", "i would like", "get me", "i'm searching for")

# Generic benefit clauses for bullet points: free of colour/size words and of attributes.
BENEFITS = (
    "made to hold up to daily use",
    "a thoughtful pick for everyday routines",
    "backed by our satisfaction promise",
    "checked by hand before it ships",
    "simple to use right out of the box",
    "a favourite of our customers",
)
CARE_NOTES = {
    "beauty": "Apply as part of your daily routine and keep away from direct sunlight.",
    "electronics": "Includes a quick start guide and a one year warranty.",
    "fashion": "Follow the care label to keep it looking new.",
    "food": "Keep in a cool, dry place once opened.",
    "furniture": "Arrives with clear instructions and every part you need.",
}

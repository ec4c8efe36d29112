"""The built-in `constrained_lists` task's rows: prompts with four verifiable constraints and no reference
answer, `List exactly 4 fish, all in lowercase, separated by commas, with no item repeated.`, with the columns
its reward reads (`n`, `case`, `separator`, `rule`, `rule_value`) and the topic. The held-out rows change what
was trained: their topics and their counts appear in no training row. The verifier and the graders are in
`posttrain.environments.constraint_lists`."""

from __future__ import annotations

import random

# topic -> words that belong to it: the on-topic grade's only source; the reward never reads them.
TOPICS = {
    "fruits": "apple apricot banana blackberry blueberry cherry coconut cranberry date fig grape grapefruit "
    "guava kiwi lemon lime lychee mango melon nectarine orange papaya peach pear pineapple plum "
    "pomegranate raspberry strawberry tangerine watermelon",
    "animals": "ant bear beaver bee camel cat cheetah cow deer dog donkey elephant fox giraffe goat gorilla "
    "hippo horse kangaroo koala lion monkey mouse panda pig rabbit rhino sheep tiger wolf zebra",
    "colors": "amber azure beige black blue brown crimson cyan gold gray green indigo ivory lavender lime "
    "magenta maroon navy olive orange pink purple red scarlet silver teal turquoise violet white yellow",
    "vegetables": "artichoke asparagus beet broccoli cabbage carrot cauliflower celery corn cucumber "
    "eggplant garlic kale leek lettuce mushroom okra onion parsnip pea pepper potato pumpkin radish spinach "
    "squash tomato turnip yam zucchini",
    "sports": "archery badminton baseball basketball boxing cricket cycling diving fencing football golf "
    "gymnastics handball hockey judo karate lacrosse polo rowing rugby running sailing skiing soccer "
    "surfing swimming tennis volleyball wrestling",
    "countries": "argentina australia austria brazil canada chile china denmark egypt finland france germany "
    "greece india ireland italy japan kenya mexico nigeria norway peru poland portugal russia spain "
    "sweden thailand turkey vietnam",
    "tools": "anvil axe chisel clamp drill file hammer hoe ladder level mallet pliers rake saw scissors "
    "screwdriver shovel sander spade tape trowel vise wrench wheelbarrow knife crowbar awl plane",
    "birds": "albatross blackbird canary cardinal crow dove duck eagle falcon finch flamingo goose gull hawk "
    "heron hummingbird jay kingfisher magpie ostrich owl parrot peacock pelican penguin pigeon raven "
    "robin sparrow swan",
    "fish": "anchovy bass carp catfish cod eel flounder grouper haddock halibut herring mackerel marlin "
    "minnow perch pike piranha salmon sardine shark snapper sole sturgeon swordfish tilapia trout tuna",
    "flowers": "aster begonia carnation chrysanthemum daffodil daisy dahlia gardenia geranium hibiscus "
    "hyacinth iris jasmine lavender lilac lily lotus magnolia marigold orchid pansy peony petunia poppy "
    "rose sunflower tulip violet zinnia",
    "instruments": "accordion banjo bass bassoon cello clarinet cymbal drum flute guitar harmonica harp "
    "harpsichord horn lute mandolin oboe organ piano piccolo saxophone sitar tambourine trombone "
    "trumpet tuba ukulele viola violin xylophone",
    "metals": "aluminum brass bronze chromium cobalt copper gold iron lead lithium magnesium mercury nickel "
    "platinum silver steel tin titanium tungsten uranium zinc palladium sodium potassium calcium",
    "furniture": "armchair bed bench bookcase cabinet chair couch cradle crib cupboard desk dresser futon "
    "hammock nightstand ottoman recliner shelf sideboard sofa stool table wardrobe bunk dresser",
    "drinks": "beer cider cocoa coffee cola juice kombucha lemonade milk mojito punch rum sake smoothie soda "
    "tea tequila vodka water whiskey wine espresso latte cappuccino gin brandy",
    "clothes": "belt blazer blouse boots cap cardigan coat dress gloves gown hat hoodie jacket jeans jumper "
    "leggings mittens pajamas raincoat robe sandals scarf shirt shoes shorts skirt socks sweater tie vest",
    "trees": "acacia alder ash aspen bamboo baobab beech birch cedar cherry chestnut cypress elm eucalyptus "
    "fir hazel hemlock juniper larch linden magnolia maple oak olive palm pine poplar redwood spruce "
    "sycamore willow yew",
    "insects": "ant aphid bee beetle butterfly cicada cockroach cricket dragonfly earwig firefly flea fly "
    "gnat grasshopper hornet ladybug locust mantis mosquito moth termite tick wasp weevil",
    "planets": "mercury venus earth mars jupiter saturn uranus neptune pluto ceres eris",
    "vehicles": "ambulance bicycle boat bus car canoe ferry helicopter jeep kayak limousine motorcycle plane "
    "rocket scooter ship skateboard sled submarine tank taxi tractor train tram truck van wagon yacht",
    "spices": "allspice anise basil cardamom cayenne chili cinnamon clove coriander cumin curry dill fennel "
    "garlic ginger mint mustard nutmeg oregano paprika parsley pepper rosemary saffron sage salt "
    "sesame thyme turmeric vanilla",
}
HELD_OUT_TOPICS = ("fish", "instruments", "trees", "insects", "vehicles", "spices")
TRAIN_COUNTS = (2, 3, 4, 6)
HELD_OUT_COUNTS = (5, 7)
CASES = {
    "lower": "all in lowercase",
    "upper": "all in uppercase",
    "capitalized": "each starting with a capital letter",
}
SEPARATORS = {",": "commas", ";": "semicolons"}
RULES = ("distinct", "max_letters", "include", "exclude")


def constraint_row(
    topic: str,
    n: int,
    rng: random.Random,
    cases: tuple[str, ...] = tuple(CASES),
    separators: tuple[str, ...] = tuple(SEPARATORS),
    rules: tuple[str, ...] = RULES,
) -> dict:
    """One row: a prompt asking for `n` items of `topic` with a case, a separator and a rule drawn by
    `rng` (from `cases`, `separators`, `rules`), and the columns the reward reads; no answer."""
    case, separator, rule = rng.choice(cases), rng.choice(separators), rng.choice(rules)
    value = ""
    if rule == "max_letters":
        value = str(rng.randint(5, 8))
    elif rule in ("include", "exclude"):
        value = rng.choice(TOPICS[topic].split())
    phrase = {
        "distinct": "with no item repeated",
        "max_letters": f"each at most {value} letters long",
        "include": f"including {value}",
        "exclude": f"without {value}",
    }[rule]
    prompt = (
        f"List exactly {n} {topic}, {CASES[case]}, separated by {SEPARATORS[separator]}, {phrase}. "
        "Reply with the list only."
    )
    columns = {"n": n, "case": case, "separator": separator, "rule": rule, "rule_value": value}
    return {"prompt": prompt, **columns, "topic": topic, "task_name": "lists"}


def constrained_list_rows(num_train: int, num_val: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Training rows from the training topics and counts; validation rows from the held-out ones only."""
    rng = random.Random(seed)
    train_topics = [t for t in TOPICS if t not in HELD_OUT_TOPICS]
    train = [
        constraint_row(rng.choice(train_topics), rng.choice(TRAIN_COUNTS), rng) for _ in range(num_train)
    ]
    val = [
        constraint_row(rng.choice(HELD_OUT_TOPICS), rng.choice(HELD_OUT_COUNTS), rng) for _ in range(num_val)
    ]
    return train, val

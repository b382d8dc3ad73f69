"""Ours against llama.cpp's own server, one sitting, on 24 requests of six kinds that no training
corpus of this project contains (written for this benchmark): conversation, translation,
summarisation of long articles, short factual QA, maths word problems, answers from retrieved
passages (four each; the summaries and the retrieval answers have 400-700-token prompts).

    python benchmarks/vs_llamacpp.py --export-dir /work/cache/exports/smollm2-int4 \
        --out benchmarks/vs_llamacpp_2026-12-01

runs ONE `arborspec bench` (every configuration on prompt 1, then on prompt 2, ...: interleaved,
ours, theirs, ours, theirs; `--rounds N` sends the 24 requests N times in the same bench, so the
rounds are interleaved too) with our vanilla, our tuned tree (`--tree auto`), the head mixed with
lookup (`--mix-tree auto`), the suffix draft alone and with the head (`--suffix-tree auto`,
`--suffix-mix-tree auto`), llama-server vanilla / ngram-mod / draft-eagle3 (the export's head
converted by llama.cpp's converter), each with weight repacking on and off (`-repack-on` /
`-repack-off`: which is faster depends on the weight type and the hour), and OpenVINO GenAI on the
same GGUF, plain and with its prompt lookup; 128 new tokens, greedy, chat template applied by our
tokenizer and the same ids sent to every engine. Writes OUT/prompts.json, OUT/bench.json (bench's
own results) and OUT/summary.md (median decode tok/s per configuration and per kind, llama.cpp's
faster repacking setting per configuration, the ratios per round, tokens per target call per kind,
time to first token of the long prompts, the load average before and after). Tune the export's
trees first (`arborspec tune --export-dir E` and `--draft export+lookup`) for `auto` to mean something.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

KINDS = ("conversation", "translation", "summarisation", "qa", "math", "retrieval")
LONG_KINDS = ("summarisation", "retrieval")
BASELINES = ",".join(
    [f"llama-server{c}-repack-{s}" for c in ("", "-ngram-mod", "-eagle3") for s in ("on", "off")]
    + ["openvino", "openvino-lookup"]
)

CONVERSATION = [
    "I just moved into a flat with a tiny balcony that gets sun only in the morning. I'd like to grow "
    "something I can eat. What would you suggest, and how should I start?",
    "My younger brother keeps borrowing my bike without asking and returned it with a flat tyre "
    "yesterday. How can I bring this up with him without starting a fight?",
    "I have a job interview on Thursday for a library assistant position. I'm nervous because I've "
    "never worked in a library. Can you help me think about what they might ask?",
    "We're planning a picnic for eight people this Saturday, but the forecast says clouds and a "
    "chance of drizzle in the afternoon. Should we go ahead, and what should we bring just in case?",
]

TRANSLATION = [
    "Translate into French: The train to the coast leaves at half past nine, so please meet me at "
    "the station café a little before that. Don't forget your umbrella.",
    "Translate into Spanish: Our neighbours have a small orchard behind their house, and every "
    "autumn they give us a basket of apples and pears.",
    "Translate into German: The museum is closed on Mondays, but on Tuesday mornings entry is free "
    "for students and teachers.",
    "Translate into English: La bibliothèque municipale organise un atelier de lecture pour les "
    "enfants chaque mercredi après-midi. L'inscription est gratuite mais les places sont limitées.",
]

QA = [
    "What is the boiling point of water at sea level in degrees Fahrenheit?",
    "Which planet in our solar system has the most moons known so far?",
    "Who wrote the novel 'Pride and Prejudice'?",
    "What gas do plants take in from the air to make their food?",
]

MATH = [
    "A bakery sells muffins at 3 dollars each or a box of 6 for 15 dollars. Maya needs 14 muffins. "
    "What is the least she can pay? Show your reasoning step by step.",
    "A cyclist rides 18 km in the first hour, 15 km in the second hour and 12 km in the third hour. "
    "If she keeps slowing down by 3 km each hour, how far will she have ridden after five hours?",
    "A water tank holds 1,200 litres. It is filled at 40 litres per minute while a leak drains 10 "
    "litres per minute. Starting empty, how many minutes does it take to fill? Explain.",
    "In a class of 30 pupils, two fifths walk to school, one third come by bus and the rest are "
    "driven. How many pupils are driven to school? Work it out step by step.",
]

ARTICLES = [
    (
        "The town of Harrowgate Vale, a community of about eleven thousand people in a river valley, "
        "spent most of the last decade arguing about its bridge. The old stone bridge over the Lenn, "
        "built in 1871, carries the only road that links the northern and southern halves of the town. "
        "Engineers who inspected it in 2016 found that two of its five arches had shifted, that water "
        "was getting into the mortar, and that heavy lorries were speeding up the damage. They "
        "recommended a weight limit of seven tonnes, which the council brought in the following spring. "
        "The limit solved one problem and created several others. Delivery lorries now had to take a "
        "detour of twenty-two kilometres through the hills to reach the supermarket and the industrial "
        "estate on the southern bank. The fire service, whose only station sits on the northern side, "
        "found that its largest engine was over the limit; for two years it kept a smaller engine on "
        "standby in a rented garage south of the river, at a cost of about ninety thousand pounds a "
        "year. Shop owners on the high street said the detour added to their prices, and a survey by "
        "the chamber of commerce suggested that footfall on the southern side fell by almost a fifth. "
        "The council considered three options. The first was to repair the old bridge and keep the "
        "weight limit, which would cost around two million pounds but leave the detour in place. The "
        "second was to strengthen the bridge with a concrete deck hidden inside the arches, which would "
        "allow full traffic but change the look of a listed structure; heritage groups opposed it "
        "strongly. The third was to build a new bridge four hundred metres downstream and keep the old "
        "one for walkers and cyclists. That option was the most expensive, at an estimated fourteen "
        "million pounds, and it needed land from two farms. After a public consultation in which more "
        "than three thousand residents took part, the council chose the third option in 2021. Funding "
        "came from a regional transport grant, which covered two thirds of the cost, and from a loan "
        "that the council will repay over thirty years. Construction began in March 2022 and was "
        "expected to take eighteen months. It took twenty-six. Flooding in the winter of 2022 washed "
        "away part of the temporary works, a supplier of steel beams went out of business, and the "
        "contractor had to redesign one of the foundations after finding soft clay where the surveys "
        "had shown gravel. The final cost rose to seventeen and a half million pounds. The new bridge "
        "opened in May 2024. Early figures show that lorry traffic on the high street has fallen, the "
        "fire service has returned its standby engine, and the old stone bridge, now closed to cars, "
        "has become a popular place for the Saturday market. Critics point out that the council's "
        "debt has grown and that the loan repayments will limit spending on other projects, including "
        "a new swimming pool that residents had been promised. The council's leader said the decision "
        "had been the right one even at the higher price, because the town could not go on being cut "
        "in half."
    ),
    (
        "For most of the twentieth century, the small island of Korrin produced almost nothing but "
        "wool. Its four hundred inhabitants kept sheep on the windswept hills, sold fleeces to "
        "merchants on the mainland, and depended on a ferry that ran twice a week in summer and once a "
        "week in winter. When wool prices collapsed in the 1990s, young people began to leave, and by "
        "2010 the population had dropped to just over two hundred, most of them older than sixty. The "
        "island's school closed in 2012 when its last three pupils moved away. Two years later a group "
        "of residents formed a community trust with a simple aim: to give people a reason to stay. "
        "Their first project was a small wind turbine, paid for with a mix of grants and a share offer "
        "that raised money from islanders and from people on the mainland who had family ties to Korrin. "
        "The turbine began turning in 2016. It supplies most of the island's electricity, and the "
        "income from selling surplus power to the grid, around sixty thousand pounds a year, goes into "
        "a fund that the trust spends on local projects. The second project was housing. Many houses "
        "on the island stood empty because their owners lived elsewhere and used them only for a few "
        "weeks each summer. The trust bought four derelict cottages, renovated them with help from "
        "volunteers, and rented them at low cost to families willing to live on the island all year. "
        "Applicants had to show that they could earn a living there, which proved the hardest part. "
        "The trust responded by setting up a shared workspace with a fast internet connection in the "
        "old school building, so that people with jobs that could be done remotely could move. A "
        "graphic designer, a software tester and an accountant were among the first new residents. "
        "Tourism also changed. Instead of day visitors who arrived on the ferry, walked to the "
        "lighthouse and left, the trust promoted longer stays built around the island's birdlife and "
        "its traditional knitting. A weaving studio reopened, selling blankets made from the wool of "
        "the island's own sheep at prices far higher than raw fleece had ever fetched. By 2023 the "
        "population had risen to two hundred and sixty, and the school reopened with nine pupils. The "
        "trust's members are careful not to overstate their success. The ferry service is still "
        "unreliable, the cost of building materials makes every renovation slow, and some older "
        "residents feel that the island is changing too fast. There have been disagreements about how "
        "to spend the turbine income, with some wanting to lower electricity bills and others wanting "
        "to fund more houses. But visitors from other islands now come to Korrin to learn how the "
        "trust was organised, and two neighbouring communities have started similar projects."
    ),
    (
        "When the Meridale Hospital opened a new emergency department in 2019, its managers expected "
        "waiting times to fall. The building was twice the size of the old one, with more cubicles, a "
        "separate area for children and a dedicated unit for patients with minor injuries. Instead, "
        "within a year, average waits had grown longer. A review commissioned by the hospital board "
        "tried to explain why. The first finding was that the new department attracted more patients. "
        "Local family doctors' surgeries had reduced their evening hours at about the same time, and "
        "people who could not get an appointment went to the hospital instead. Attendances rose by "
        "fourteen per cent in two years, far more than the planners had allowed for. The second "
        "finding concerned what happened after patients were seen. The emergency department itself "
        "worked faster than before, with most patients examined within an hour of arriving. But those "
        "who needed to be admitted often waited many hours for a bed on a ward, and while they waited "
        "they occupied cubicles that new arrivals needed. The review traced the shortage of ward beds "
        "to two causes. One was that patients who were well enough to leave hospital could not always "
        "be discharged, because there was no place for them in a care home or no support available at "
        "home. On a typical day, about sixty beds were filled by such patients. The other was that "
        "discharges happened late in the day: doctors made their ward rounds in the morning, but the "
        "paperwork, the medicines to take home and the transport were often not ready until the "
        "evening, long after the morning rush in the emergency department. The review made several "
        "recommendations. It suggested that wards should aim to discharge a third of their patients "
        "before noon, that a pharmacy team should prepare take-home medicines the day before, and that "
        "a discharge lounge should be opened where patients could wait comfortably for transport "
        "without occupying a bed. It also proposed that the hospital work with the local council to "
        "fund more places in care homes and more home-care visits, arguing that each delayed "
        "discharge cost the hospital far more than the care it was waiting for. Finally, it proposed "
        "that an urgent treatment centre run by family doctors be placed next to the emergency "
        "entrance, so that patients with minor problems could be directed there. The hospital adopted "
        "most of the recommendations in 2022. Early results are mixed. The share of morning "
        "discharges rose from eight to twenty-one per cent, and the discharge lounge is busy. The "
        "urgent treatment centre sees about eighty patients a day. But the number of patients waiting "
        "for care home places has barely changed, because the council says it cannot find enough "
        "staff, and waiting times in the emergency department, though shorter than at their worst, are "
        "still above the national target."
    ),
    (
        "A study published by the Institute for Urban Ecology followed forty-two small city parks over "
        "six years to see how changes in their management affected the insects and birds living in "
        "them. Until 2017 all the parks were looked after in the same way: grass was cut every two "
        "weeks from April to October, fallen leaves were cleared, and flower beds were planted with "
        "the same annual bedding plants each spring. In 2018 the city agreed to let the researchers "
        "change the routine in half of the parks, chosen at random. In those parks, large areas of "
        "grass were cut only twice a year, piles of dead wood were left in quiet corners, and the "
        "bedding plants were replaced with native perennial flowers that return each year. The other "
        "half carried on as before. The researchers counted bees, butterflies, beetles and birds each "
        "summer using the same methods and at the same times of day. By the third year, the parks with "
        "the new management had on average two and a half times as many bees and almost twice as many "
        "butterfly species as the others. Ground beetles, which live among dead wood and leaf litter, "
        "had increased even more. Bird numbers changed more slowly, but by the sixth year the managed "
        "parks had about a third more breeding pairs of small songbirds, which the authors linked to "
        "the larger supply of insects for feeding chicks. The study also looked at cost and at what "
        "visitors thought. Cutting the grass less often saved the city about eleven per cent of the "
        "parks' maintenance budget, although some of the savings were spent on signs explaining the "
        "changes and on extra litter picking, because long grass hid rubbish. Surveys of visitors "
        "showed that opinions were divided at first. In the first year, a quarter of those asked said "
        "the parks looked untidy or neglected, and the council received complaints. Many people "
        "worried about ticks or about children being unable to play. In response, the city began to "
        "mow wide paths through the long grass and to keep a short-cut area near playgrounds and "
        "benches. By the sixth year the share of visitors who described the parks as untidy had "
        "fallen to one in ten, and more than half said they enjoyed seeing the flowers and insects. "
        "The authors caution that small parks cannot replace larger natural areas, and that the "
        "results may differ in cities with other climates. They also note that some species, "
        "including a few that depend on bare ground, did better in the regularly mown parks. Still, "
        "they conclude that modest changes to routine care can make city parks considerably richer in "
        "wildlife at no extra cost, provided residents are told what is being done and why."
    ),
]

RETRIEVAL = [
    (
        "Passage 1: The Ostvik cable car opened in 1962 and climbs from the harbour to the top of Mount "
        "Ulla, a rise of 410 metres. It has two cabins, each carrying up to 28 passengers, and a trip "
        "takes about seven minutes. The cable car was rebuilt in 2009, when the old cabins were replaced "
        "with larger ones that have glass floors. It runs every fifteen minutes from 9 a.m. to 9 p.m. "
        "between May and September, and from 10 a.m. to 5 p.m. in the rest of the year, except when the "
        "wind is stronger than 20 metres per second. A return ticket costs 290 kroner for adults and "
        "150 kroner for children aged four to fifteen; children under four travel free.\n"
        "Passage 2: At the top of Mount Ulla there is a restaurant, a viewing platform and the starting "
        "point of several walking trails. The longest, the Ridge Trail, is 11 kilometres long and leads "
        "along the mountain crest to the village of Brenna, from where a bus returns to the harbour "
        "every hour. The shortest trail is a 1.5-kilometre loop around a small lake, suitable for "
        "families with pushchairs in summer. In winter, the loop is used for cross-country skiing and "
        "the cable car carries skis free of charge.\n"
        "Passage 3: Many visitors choose to walk up the mountain instead of taking the cable car. The "
        "path from the harbour has more than 1,300 stone steps, laid by volunteers between 2012 and "
        "2016. Most fit walkers reach the top in about an hour. Walking down is not recommended in icy "
        "conditions, and the town advises visitors to buy a one-way ticket for the descent, which costs "
        "190 kroner for adults.\n"
        "Using only the passages above, answer: A family of two adults and two children aged 3 and 9 "
        "want to take the cable car up and back in October. When can they travel, and how much will "
        "they pay in total?"
    ),
    (
        "Passage 1: The Farrow Valley Community Library lends more than just books. Since 2020 it has run "
        "a tool library, where members can borrow drills, ladders, garden shears, sewing machines and "
        "about two hundred other items for up to one week. Membership is free for residents of the "
        "valley; others pay 12 pounds a year. Each member may borrow at most three tools at a time, and "
        "power tools require a short safety session, held on the first Saturday of every month.\n"
        "Passage 2: Tools must be returned clean and on time. A late return costs 50 pence per day per "
        "tool, up to a maximum of 10 pounds. Members who return a tool damaged are asked to pay part of "
        "the repair cost, which the library decides case by case. The tool library is open on "
        "Tuesdays and Thursdays from 4 p.m. to 7 p.m. and on Saturdays from 10 a.m. to 1 p.m.; it is "
        "closed during the last two weeks of August for maintenance.\n"
        "Passage 3: The project began with donations from residents who had tools they rarely used. "
        "Volunteers check every tool when it comes back, sharpen blades and replace worn parts. In its "
        "first three years the tool library made more than 6,000 loans. The most borrowed items are "
        "the carpet cleaner, the pressure washer and the long ladder, which often have waiting lists in "
        "spring. Members can reserve an item online up to two weeks in advance.\n"
        "Using only the passages above, answer: I live outside the valley and want to borrow an electric "
        "hedge trimmer and a ladder next month. What do I need to do first, what will it cost me, and "
        "when can I pick them up?"
    ),
    (
        "Passage 1: The Selbourne Marathon takes place every year on the second Sunday of April. The "
        "route starts in Victoria Park, follows the canal towpath for the first twelve kilometres, "
        "crosses the old town and finishes on the river embankment. Runners must be at least eighteen "
        "on the day of the race. Entry costs 65 pounds until the end of December and 80 pounds from "
        "January until entries close on the first of March.\n"
        "Passage 2: There is a strict time limit of six and a half hours. Runners who have not reached "
        "the 30-kilometre point within four hours and forty minutes are asked to leave the course and "
        "are taken to the finish by bus. Water stations are placed every five kilometres, and energy "
        "gels are handed out at kilometres 15, 25 and 35. Headphones are allowed but runners are asked "
        "to keep the volume low enough to hear marshals' instructions.\n"
        "Passage 3: For people who do not want to run the full distance, the organisers hold a 10 km "
        "race on the same morning, starting an hour after the marathon. It is open to anyone aged "
        "fifteen or older and costs 25 pounds. A relay option lets teams of four share the marathon "
        "distance; each team pays 180 pounds and the changeover points are at kilometres 10, 21 and 32. "
        "All finishers receive a medal, and the first three men and women in each age group receive a "
        "prize.\n"
        "Using only the passages above, answer: My sixteen-year-old daughter and I want to run together. "
        "Which races could we enter as a pair, and what is the cheapest way for both of us to take part "
        "if we sign up in February?"
    ),
    (
        "Passage 1: The Brightwater Museum of Clocks holds about 1,400 clocks and watches, from medieval "
        "tower mechanisms to quartz wristwatches of the 1970s. The main galleries are arranged by "
        "period, and a workshop on the ground floor lets visitors watch restorers at work on Wednesdays "
        "and Fridays. The museum is open from Tuesday to Sunday, 10 a.m. to 5 p.m., and on the first "
        "Thursday of each month it stays open until 9 p.m.\n"
        "Passage 2: Admission is 9 pounds for adults, 6 pounds for students and people over 65, and free "
        "for children under 12 when accompanied by an adult. A family ticket for two adults and up to "
        "three children aged 12 to 17 costs 22 pounds. Tickets bought online are 10 per cent cheaper. "
        "Every hour on the hour, a guide demonstrates the great astronomical clock in the central hall; "
        "the demonstration lasts about twenty minutes.\n"
        "Passage 3: The museum café is on the top floor and serves lunch from 12 to 2:30 p.m. Visitors "
        "with reduced mobility can use the lift at the back of the building; wheelchairs can be "
        "borrowed free of charge at the ticket desk. Photography without flash is allowed everywhere "
        "except in the workshop. Large bags must be left in the lockers near the entrance, which take a "
        "one-pound coin that is returned.\n"
        "Using only the passages above, answer: Two adults and their children aged 10 and 14 plan to "
        "visit on a Friday and want to see both the restorers and the astronomical clock. What is the "
        "cheapest way to buy tickets, and how should they plan their visit?"
    ),
]


def prompts(rounds: int = 1) -> list[dict]:
    """The 24 requests: chat prompts (our tokenizer's template) of the six kinds, four each; with
    rounds > 1 the 24 again, ids suffixed @2, @3, ... (one bench: every round interleaved)."""
    texts = {
        "conversation": CONVERSATION,
        "translation": TRANSLATION,
        "summarisation": [f"Summarise the following article in a short paragraph.\n\n{a}" for a in ARTICLES],
        "qa": QA,
        "math": MATH,
        "retrieval": RETRIEVAL,
    }
    out = []
    for r in range(1, rounds + 1):
        for kind in KINDS:
            for i, text in enumerate(texts[kind]):
                tag = f"{kind}-{i + 1}" + (f"@{r}" if r > 1 else "")
                out.append({"id": tag, "category": kind, "text": text, "chat": True})
    return out


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summary(results: dict) -> str:
    """Markdown: median decode tok/s per configuration (all, per kind), tokens per target call per
    kind, time to first token on the long kinds."""
    names = [c["name"] for c in results["configs"]]
    per = results["per_prompt"]

    def cell(name, kinds, key):
        return _median([p["runs"][name][key] for p in per if p["category"] in kinds and name in p["runs"]])

    def fmt(x, f="{:.1f}"):
        return "-" if x is None else f.format(x)

    lines = ["| configuration | all | " + " | ".join(KINDS) + " |", "|---" * (len(KINDS) + 2) + "|"]
    for n in names:
        row = [fmt(cell(n, KINDS, "tokens_per_s"))] + [fmt(cell(n, (k,), "tokens_per_s")) for k in KINDS]
        lines.append(f"| {n} | " + " | ".join(row) + " |")
    lines += ["", *best_of_repacking(names, per), "", *per_round(names, per)]
    lines += ["", "tokens per target call (median):", "", lines[0], lines[1]]
    for n in names:
        row = [fmt(cell(n, KINDS, "mean_accepted"), "{:.2f}")]
        row += [fmt(cell(n, (k,), "mean_accepted"), "{:.2f}") for k in KINDS]
        lines.append(f"| {n} | " + " | ".join(row) + " |")
    lines += ["", "time to first token, long prompts (median ms; prompt tokens " + _lengths(per) + "):", ""]
    lines += ["| configuration | " + " | ".join(LONG_KINDS) + " |", "|---" * (len(LONG_KINDS) + 1) + "|"]
    for n in names:
        row = [fmt(None if (v := cell(n, (k,), "ttft_s")) is None else 1e3 * v, "{:.0f}") for k in LONG_KINDS]
        lines.append(f"| {n} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _round(p: dict) -> int:
    return int(p["id"].split("@")[1]) if "@" in p["id"] else 1


def _median_rate(per, name, rnd=None):
    return _median([p["runs"][name]["tokens_per_s"] for p in per if name in p["runs"] and rnd in (None, _round(p))])


def best_of_repacking(names: list[str], per: list[dict]) -> list[str]:
    """llama.cpp's faster repacking setting per configuration (median decode tok/s, all requests)."""
    out = ["llama.cpp, the faster repacking setting per configuration (median tok/s, all requests):", ""]
    out += ["| configuration | repacking on | repacking off | kept |", "|---|---|---|---|"]
    for base in dict.fromkeys(n.rsplit("-repack-", 1)[0] for n in names if "-repack-" in n):
        on, off = _median_rate(per, base + "-repack-on"), _median_rate(per, base + "-repack-off")
        kept = "-" if on is None or off is None else ("on" if on >= off else "off")
        out.append(f"| {base} | {on or 0:.1f} | {off or 0:.1f} | {kept} |")
    return out


def per_round(names: list[str], per: list[dict]) -> list[str]:
    """Median tok/s per round (each round all 24 requests), and ours against the best peer."""
    rounds = sorted({_round(p) for p in per})
    ours = [n for n in names if n == "vanilla" or not n.startswith(("llama-", "openvino", "ort-genai", "hf-"))]
    theirs = [n for n in names if n not in ours]
    out = ["median tok/s per round (interleaved: every configuration on each request in turn):", ""]
    out += ["| configuration | " + " | ".join(f"round {r}" for r in rounds) + " |", "|---" * (len(rounds) + 1) + "|"]
    table = {n: [_median_rate(per, n, r) for r in rounds] for n in names}
    for n in names:
        out.append(f"| {n} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in table[n]) + " |")
    for label, mine, peers in (
        (
            "our vanilla / llama.cpp's best vanilla",
            ["vanilla"],
            [n for n in theirs if n in ("llama-server", "llama-server-repack-on", "llama-server-repack-off")],
        ),
        ("our best / llama.cpp's best (any mode)", ours, [n for n in theirs if n.startswith("llama-server")]),
        ("our best speculation / our vanilla", [n for n in ours if n != "vanilla"], ["vanilla"]),
        ("our vanilla / OpenVINO's best", ["vanilla"], [n for n in theirs if n.startswith("openvino")]),
        ("our best / OpenVINO's best", ours, [n for n in theirs if n.startswith("openvino")]),
    ):
        cells = []
        for i in range(len(rounds)):
            a = max((table[n][i] or 0 for n in mine), default=0)
            b = max((table[n][i] or 0 for n in peers), default=0)
            cells.append(f"{a / b:.2f}x" if a and b else "-")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def _lengths(per) -> str:
    lens = [p["prompt_tokens"] for p in per if p["category"] in LONG_KINDS]
    return f"{min(lens)}-{max(lens)}" if lens else "-"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export-dir", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path, help="folder for prompts.json, bench.json, summary.md")
    ap.add_argument("--baselines", default=BASELINES)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--extra", default="", help="more `arborspec bench` arguments, one string")
    ap.add_argument("--rounds", type=int, default=1, help="send the 24 requests this many times (interleaved)")
    ap.add_argument("--summary-only", action="store_true", help="re-summarise OUT/bench.json")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    bench_json = args.out / "bench.json"
    if not args.summary_only:
        (args.out / "prompts.json").write_text(json.dumps({"prompts": prompts(args.rounds)}, indent=1))
        exe = Path(sys.executable).with_name("arborspec")  # this venv's command
        cmd = [str(exe) if exe.is_file() else "arborspec"]
        cmd += ["bench", "--export-dir", str(args.export_dir), "--backend", "onnxruntime"]
        cmd += ["--modes", "vanilla,tree", "--tree", "auto", "--mix-tree", "auto", "--baselines", args.baselines]
        cmd += ["--suffix-tree", "auto", "--suffix-mix-tree", "auto"]  # the suffix draft alone and with the head
        cmd += ["--prompts", str(args.out / "prompts.json"), "--max-new-tokens", str(args.max_new_tokens)]
        cmd += ["--json-out", str(bench_json), "--quiet"] + args.extra.split()
        print("$ " + " ".join(cmd), file=sys.stderr)
        before = os.getloadavg()
        rc = subprocess.run(cmd).returncode
        if rc != 0:
            return rc
        (args.out / "load.json").write_text(json.dumps({"before": before, "after": os.getloadavg()}))
    text = summary(json.loads(bench_json.read_text()))
    if (args.out / "load.json").is_file():
        load = json.loads((args.out / "load.json").read_text())
        text += f"\nload average (1, 5, 15 min) before: {load['before']}, after: {load['after']}\n"
    (args.out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

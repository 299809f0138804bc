"""The quickstart's corpus generator (what `data.generate=synthetic` writes), not part of the data pipeline.

It writes an English → German parallel corpus from a seeded grammar: real translation problems, no
download. The pipeline that reads corpora (`data.corpus`, `data.vocab`, `data.pipeline`, `data.batching`)
never imports it: train.py calls `write_corpus` to put the files at the data prefixes
(configs/data/quickstart.yaml), and the pipeline then reads them as it reads a real corpus.

The source is simple English; the target is grammatical German built from the same sentence tree, so
every source sentence has exactly one correct translation (the mapping is a function, and a small model
can reach a high BLEU), yet the model must learn what makes English → German hard:

- **Gender, case and number.** Every noun has a gender (der Hund, die Katze, das Kind); "the" becomes
  der/die/das/den/dem/des by the noun's role: subject (nominative), object (accusative), the object of
  helfen/folgen/danken and the indirect object of geben/zeigen/bringen (dative), the
  possessor of "the man's dog" (genitive: "der Hund des Mannes", with the possessor moved behind).
  Prepositions govern case (mit dem Hund, ohne den Hund) and contract (in dem → im, an dem → am).
  Weak nouns (den Jungen) and dative plurals (mit den Kindern) are inflected.
- **Adjective declension.** Weak after der/dieser (der große Hund), mixed after ein/kein/mein (ein großer
  Hund, eine große Katze, ein großes Haus), strong without an article (zwei große Hunde, Annas großer
  Hund); predicative adjectives are bare (der Hund ist groß).
- **Verb agreement** with person and number (ich sehe, er sieht, wir sehen), stem changes and umlauts
  (sieht, läuft, isst, mag), and lexical choices English does not make: "eat" is fressen for animals,
  "know" is kennen with a noun and wissen with a clause, "must not" is "darf nicht", "wants to" is "will".
- **Word order.** Verb-second main clauses: a fronted adverb or clause inverts the subject ("Gestern hat
  der Hund die Katze gesehen"). The verb bracket: English "saw" becomes "hat ... gesehen" (sein for
  motion: "ist ... gelaufen"), "will see" becomes "wird ... sehen", separable verbs split ("ruft ... an").
  Subordinate clauses (dass, ob, weil, obwohl, wenn / als by tense) and relative clauses put the finite
  verb last ("..., dass der Hund die Katze gesehen hat"). Adverbs move from the end of the English
  clause into the middle field ("The dog sees the cat today." → "Der Hund sieht heute die Katze.").
  Questions put the verb first; relative clauses on objects are extraposed behind the participle.
- **Negation.** "not" becomes nicht behind the objects ("Der Hund hat die Katze nicht im Garten
  gesehen."), but a negated "a" or bare plural becomes kein ("The dog did not see a cat." → "Der Hund
  hat keine Katze gesehen.").
- Orthography: German nouns are capitalised, commas mark every subordinate clause, and words carry
  umlauts and ß (Bär, hören, groß), so the vocabulary must handle non-ASCII text.

The grammar: a sentence is a simple clause, a clause with a complement clause ("Anna says that ..."),
an adverbial clause at the end or the front ("Because ..., ..."), a relative clause on the subject or
the object, a yes/no or wh-question, or two coordinated clauses. A clause has a subject (a noun phrase,
a name, a pronoun, or two coordinated noun phrases), a verb of one of five frames (intransitive,
accusative, dative, ditransitive, clausal) or the copula with an adjective or a place, a tense
(present, past → Perfekt, future, can / must / wants to), optional negation, a frequency or time adverb,
and prepositional phrases of place, company, purpose or path. Noun phrases take a determiner (the, a,
this/these, my/his/her/our/their, a number, many, none in the plural, a possessor), an optional
adjective and, on subjects, a place. Nouns are drawn by meaning (only people say things, animals eat,
letters are written), and a clause is drawn so that its English has one reading: a constituent after a
relative or complement clause always belongs to that clause. Source sentences have 4-16 words.

The lexicon is small on purpose (40 nouns, 34 verbs, 17 adjectives, 6 names, 10 adverbs: about 370
English and 610 German word forms) and sentences are short (9 words on average), so that the
quickstart's budget of a few CPU minutes suffices to translate it almost perfectly; a larger draft grammar
(more lemmas, longer sentences) learned far slower at the same budget (docs/BENCHMARKS.md, "Quickstart",
has what the preset reaches).

Sentences are deduplicated by their source, so held-out splits never occur in training::

    python -m quickstart.corpus runs/quickstart/corpus       # writes train/valid/test .en/.de there
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from data.files import atomic_write

log = logging.getLogger(__name__)

GRAMMAR_VERSION = 1  # bump on any change to the output: corpora written by another version are rewritten
SRC_LANG, TGT_LANG = "en", "de"
MIN_WORDS, MAX_WORDS = 4, 16  # source sentence length in words, punctuation attached
DEFAULT_SIZES = {"train": 30000, "valid": 500, "test": 1000}

# Agreement keys: "sg1" (I), "sg3" (he, the dog), "pl" (we, they, the dogs). No "you": English does
# not say which of du / ihr / Sie it means, and an ambiguous source would cap BLEU.
CASES = ("nom", "acc", "dat", "gen")

# =====================================================================================================
# Lexicon
# =====================================================================================================


@dataclass(frozen=True)
class Noun:
    en: str
    en_pl: str
    gender: str  # "m" | "f" | "n"
    de: str
    de_pl: str
    de_gen: str  # genitive singular (des Hundes)
    kind: str  # person | animal | food | drink | thing | text | place | fixture
    de_obl: str  # accusative and dative singular (the same as `de` except for weak nouns: den Jungen)
    mass: bool  # singular only, no "a" (the milk)
    loc: tuple[str, ...]  # prepositions this noun takes as a place ("in", "under", ..., "through")

    def de_form(self, case: str, plural: bool) -> str:
        if plural:
            if case == "dat" and not self.de_pl.endswith(("n", "s")):
                return self.de_pl + "n"  # dative plural: den Kindern
            return self.de_pl
        return {"nom": self.de, "gen": self.de_gen}.get(case, self.de_obl)

    @property
    def animate(self) -> bool:
        return self.kind in ("person", "animal")


# kind, English singular/plural, gender, German singular/plural/genitive; options: obl=<weak form>,
# mass, loc=<prepositions> (in on under behind next front at through).
_NOUN_TABLE = """
person man men m Mann Männer Mannes
person woman women f Frau Frauen Frau
person child children n Kind Kinder Kindes
person boy boys m Junge Jungen Jungen obl=Jungen
person girl girls n Mädchen Mädchen Mädchens
person teacher teachers m Lehrer Lehrer Lehrers
person doctor doctors m Arzt Ärzte Arztes
person friend friends m Freund Freunde Freundes
person father fathers m Vater Väter Vaters
person mother mothers f Mutter Mütter Mutter
animal dog dogs m Hund Hunde Hundes
animal cat cats f Katze Katzen Katze
animal bird birds m Vogel Vögel Vogels
animal horse horses n Pferd Pferde Pferdes
animal mouse mice f Maus Mäuse Maus
animal bear bears m Bär Bären Bären obl=Bären
food apple apples m Apfel Äpfel Apfels
food cake cakes m Kuchen Kuchen Kuchens
food egg eggs n Ei Eier Eies
drink milk - f Milch - Milch mass
drink water - n Wasser - Wassers mass
thing ball balls m Ball Bälle Balles
thing key keys m Schlüssel Schlüssel Schlüssels
thing car cars n Auto Autos Autos
thing bag bags f Tasche Taschen Tasche
thing cup cups f Tasse Tassen Tasse
thing picture pictures n Bild Bilder Bildes
text book books n Buch Bücher Buches
text letter letters m Brief Briefe Briefes
text song songs n Lied Lieder Liedes
place garden gardens m Garten Gärten Gartens loc=in,behind,front,next,through
place house houses n Haus Häuser Hauses loc=in,behind,front,next,through
place park parks m Park Parks Parks loc=in,through
place city cities f Stadt Städte Stadt loc=in,through
place school schools f Schule Schulen Schule loc=in,behind,front,next
place river rivers m Fluss Flüsse Flusses loc=at,next,through
fixture table tables m Tisch Tische Tisches loc=on,under,next,at
fixture bed beds n Bett Betten Bettes loc=on,under,next
fixture tree trees m Baum Bäume Baumes loc=under,behind,front,next
fixture door doors f Tür Türen Tür loc=at,behind,front
"""


def _parse_nouns(table: str) -> tuple[Noun, ...]:
    nouns = []
    for line in table.strip().splitlines():
        kind, en, en_pl, gender, de, de_pl, gen, *opts = line.split()
        kw = dict(o.split("=") if "=" in o else (o, "1") for o in opts)
        nouns.append(Noun(en=en, en_pl=en_pl, gender=gender, de=de, de_pl=de_pl, de_gen=gen, kind=kind,
                          de_obl=kw.get("obl", de), mass="mass" in kw,
                          loc=tuple(kw["loc"].split(",")) if "loc" in kw else ()))
    return tuple(nouns)


NOUNS = _parse_nouns(_NOUN_TABLE)
KINDS = ("person", "animal", "food", "drink", "thing", "text", "place", "fixture")


@dataclass(frozen=True)
class Adj:
    en: str
    de: str  # predicative form (groß)
    stem: str  # attributive stem the endings attach to (müde → müd-e, dunkel → dunkl-e)


_ADJ_TABLE = """
big groß - | small klein - | old alt - | young jung - | new neu - | red rot - | green grün - | black schwarz -
happy glücklich - | tired müde müd | hungry hungrig - | beautiful schön - | sweet süß - | cold kalt -
warm warm - | long lang - | short kurz -
"""
ADJECTIVES = {en: Adj(en, de, de if stem == "-" else stem)
              for en, de, stem in (a.split() for a in _ADJ_TABLE.replace("\n", " | ").split("|") if a.strip())}
ADJ_BY_KIND = {k: tuple(ADJECTIVES[a] for a in v.split()) for k, v in {
    "person": "big small old young happy tired hungry",
    "animal": "big small old young happy tired hungry black",
    "food": "big small sweet warm cold green red",
    "drink": "warm cold sweet",
    "thing": "big small old new red green black beautiful",
    "text": "long short new old beautiful",
    "place": "big small old new beautiful cold warm",
    "fixture": "big small old new beautiful red green black",
}.items()}

NAMES = ("Anna", "Maria", "Lena", "Peter", "Paul", "Tom")
NUMBERS = {"two": "zwei", "three": "drei", "four": "vier", "five": "fünf", "ten": "zehn"}
POSSESSIVES = {"my": "mein", "his": "sein", "her": "ihr", "our": "unser", "their": "ihr"}

# Personal pronouns: English subject/object, German nominative/accusative/dative, agreement key.
PRONOUNS = {
    "I": ("I", "me", "ich", "mich", "mir", "sg1"),
    "he": ("he", "him", "er", "ihn", "ihm", "sg3"),
    "she": ("she", "her", "sie", "sie", "ihr", "sg3"),
    "it": ("it", "it", "es", "es", "ihm", "sg3"),
    "we": ("we", "us", "wir", "uns", "uns", "pl"),
    "they": ("they", "them", "sie", "sie", "ihnen", "pl"),
}


@dataclass(frozen=True)
class Verb:
    frame: str  # I intransitive, T accusative object, D dative object, G ditransitive, C clausal
    en: str
    en_past: str
    en_particle: str  # look *at*, wake *up*
    de_inf: str  # full infinitive (anrufen)
    de_forms: dict  # finite present by agreement key, without a separable prefix (rufe, ruft, rufen)
    de_part: str  # past participle (angerufen)
    de_aux: str  # "haben" | "sein" in the Perfekt
    de_prefix: str  # separable prefix (an)
    subj: tuple[str, ...]  # kinds of noun that can be the subject
    objects: tuple[Noun, ...]  # nouns that can be the (direct) object
    io: tuple[Noun, ...]  # nouns that can be the indirect object (frame G)
    motion: bool  # takes a path ("runs through the park")
    comp: tuple[str, ...]  # complementizers of frame C: "that", "whether"
    animal: "Verb | None"  # the German verb used when every subject is an animal (essen → fressen)

    def en_3sg(self) -> str:
        v = self.en
        if v.endswith(("s", "sh", "ch", "x", "z", "o")):
            return v + "es"
        if v.endswith("y") and v[-2] not in "aeiou":
            return v[:-1] + "ies"
        return v + "s"


# frame, English base/past, German infinitive/1sg/3sg/participle, aux (h|s), subject kinds (A animate,
# P person), objects (kinds and nouns; "-" none); options: p=<English particle>, sep=<German prefix>,
# pl=<German plural if not the infinitive>, motion, io=<A|P>, comp=<that,whether>, animal=<inf/1sg/3sg/part>.
_VERB_TABLE = """
I sleep slept schlafen schlafe schläft geschlafen h A -
I run ran rennen renne rennt gerannt s A - motion
I walk walked laufen laufe läuft gelaufen s A - motion
I swim swam schwimmen schwimme schwimmt geschwommen s A - motion
I come came kommen komme kommt gekommen s A - motion
I sing sang singen singe singt gesungen h A -
I laugh laughed lachen lache lacht gelacht h P -
I wait waited warten warte wartet gewartet h A -
I play played spielen spiele spielt gespielt h A -
I wake woke aufwachen wache wacht aufgewacht s A - p=up sep=auf
T see saw sehen sehe sieht gesehen h A any
T find found finden finde findet gefunden h A person,animal,food,thing,text
T buy bought kaufen kaufe kauft gekauft h P animal,food,drink,thing,text
T eat ate essen esse isst gegessen h A food animal=fressen/fresse/frisst/gefressen
T drink drank trinken trinke trinkt getrunken h A drink
T love loved lieben liebe liebt geliebt h A person,animal,food
T know knew kennen kenne kennt gekannt h P person,animal,place,song
T hear heard hören höre hört gehört h A person,animal,song
T write wrote schreiben schreibe schreibt geschrieben h P letter,book,song
T open opened öffnen öffne öffnet geöffnet h P door,book,letter,bag
T visit visited besuchen besuche besucht besucht h P person,place
T call called anrufen rufe ruft angerufen h P person sep=an
T look looked anschauen schaue schaut angeschaut h A any p=at sep=an
T like liked mögen mag mag gemocht h A person,animal,food,drink,thing,text pl=mögen
D help helped helfen helfe hilft geholfen h A person,animal
D follow followed folgen folge folgt gefolgt s A person,animal
D thank thanked danken danke dankt gedankt h P person
G give gave geben gebe gibt gegeben h P food,drink,thing,text io=A
G show showed zeigen zeige zeigt gezeigt h P thing,text io=P
G bring brought bringen bringe bringt gebracht h P food,drink,thing,text io=A
C say said sagen sage sagt gesagt h P - comp=that
C think thought denken denke denkt gedacht h P - comp=that
C know knew wissen weiß weiß gewusst h P - comp=that,whether pl=wissen
C ask asked fragen frage fragt gefragt h P - comp=whether
"""

_KIND_ALIASES = {"A": ("person", "animal"), "P": ("person",), "any": KINDS}


def _nouns_for(spec: str) -> tuple[Noun, ...]:
    if spec == "-":
        return ()
    wanted = set()
    for item in spec.split(","):
        wanted.update(_KIND_ALIASES.get(item, (item,)))
    unknown = wanted - set(KINDS) - {n.en for n in NOUNS}
    assert not unknown, f"unknown nouns or kinds in the verb table: {sorted(unknown)}"
    return tuple(n for n in NOUNS if n.kind in wanted or n.en in wanted)


def _parse_verbs(table: str) -> tuple[Verb, ...]:
    verbs = []
    for line in table.strip().splitlines():
        frame, en, past, inf, sg1, sg3, part, aux, subj, objs, *opts = line.split()
        kw = dict(o.split("=") for o in opts if "=" in o)
        prefix = kw.get("sep", "")
        forms = {"sg1": sg1, "sg3": sg3, "pl": kw.get("pl", inf[len(prefix):])}
        animal = None
        if "animal" in kw:
            a_inf, a_sg1, a_sg3, a_part = kw["animal"].split("/")
            animal = Verb(frame, en, past, "", a_inf, {"sg1": a_sg1, "sg3": a_sg3, "pl": a_inf}, a_part,
                          "haben", "", (), (), (), False, (), None)
        verbs.append(Verb(
            frame=frame, en=en, en_past=past, en_particle=kw.get("p", ""), de_inf=inf, de_forms=forms,
            de_part=part, de_aux={"h": "haben", "s": "sein"}[aux], de_prefix=prefix,
            subj=_KIND_ALIASES[subj], objects=_nouns_for(objs),
            io=tuple(n for n in NOUNS if n.kind in _KIND_ALIASES[kw["io"]]) if "io" in kw else (),
            motion="motion" in opts, comp=tuple(kw["comp"].split(",")) if "comp" in kw else (),
            animal=animal))
    return tuple(verbs)


VERBS = _parse_verbs(_VERB_TABLE)

# Finite forms of the auxiliaries and modals by agreement key; English "must not" is German "darf nicht".
HABEN = {"sg1": "habe", "sg3": "hat", "pl": "haben"}
SEIN = {"sg1": "bin", "sg3": "ist", "pl": "sind"}
WAR = {"sg1": "war", "sg3": "war", "pl": "waren"}
WERDEN = {"sg1": "werde", "sg3": "wird", "pl": "werden"}
MODALS = {"can": {"sg1": "kann", "sg3": "kann", "pl": "können"},
          "must": {"sg1": "muss", "sg3": "muss", "pl": "müssen"},
          "must_not": {"sg1": "darf", "sg3": "darf", "pl": "dürfen"},
          "want": {"sg1": "will", "sg3": "will", "pl": "wollen"}}
BE_EN = {"present": {"sg1": "am", "sg3": "is", "pl": "are"}, "past": {"sg1": "was", "sg3": "was", "pl": "were"}}


@dataclass(frozen=True)
class Prep:
    en: str
    de: str
    case: str
    role: str  # loc | path | with | for


PREPS = {
    "in": Prep("in", "in", "dat", "loc"), "on": Prep("on", "auf", "dat", "loc"),
    "under": Prep("under", "unter", "dat", "loc"), "behind": Prep("behind", "hinter", "dat", "loc"),
    "next": Prep("next to", "neben", "dat", "loc"), "front": Prep("in front of", "vor", "dat", "loc"),
    "at": Prep("at", "an", "dat", "loc"), "through": Prep("through", "durch", "acc", "path"),
    "with": Prep("with", "mit", "dat", "with"), "without": Prep("without", "ohne", "acc", "with"),
    "for": Prep("for", "für", "acc", "for"),
}
CONTRACTIONS = {("in", "dem"): "im", ("an", "dem"): "am"}
PLACES = {p: tuple(n for n in NOUNS if p in n.loc) for p in ("in", "on", "under", "behind", "next", "front",
                                                            "at", "through")}
COMPANIONS = tuple(n for n in NOUNS if n.animate or n.en in ("ball", "car", "key", "bag"))


@dataclass(frozen=True)
class Adverb:
    en: str
    de: str
    kind: str  # "freq": before the English verb | "time": at the end of the English clause, or fronted
    tenses: tuple[str, ...]


_ALL_TENSES = ("present", "past", "future", "can", "must", "want")
ADVERBS = (
    Adverb("often", "oft", "freq", _ALL_TENSES), Adverb("always", "immer", "freq", _ALL_TENSES),
    Adverb("sometimes", "manchmal", "freq", _ALL_TENSES), Adverb("never", "nie", "freq", _ALL_TENSES),
    Adverb("today", "heute", "time", _ALL_TENSES),
    Adverb("now", "jetzt", "time", ("present", "can", "must", "want")),
    Adverb("yesterday", "gestern", "time", ("past",)),
    Adverb("tomorrow", "morgen", "time", ("future", "can", "must", "want")),
    Adverb("soon", "bald", "time", ("future",)),
    Adverb("in the morning", "am Morgen", "time", _ALL_TENSES),
)

# Subordinating conjunctions: English, German, tenses allowed in the clause. "when" is als in the past.
SUBORDINATORS = {"because": ("weil", _ALL_TENSES), "although": ("obwohl", _ALL_TENSES),
                 "when": ("wenn", ("present", "past", "can", "must", "want")),
                 "if": ("wenn", ("present", "can", "must", "want"))}
COMPLEMENTIZERS = {"that": "dass", "whether": "ob"}
WH_WORDS = {"where": "wo", "why": "warum", "when": "wann"}

# German declension: the article, dieser, ein-words (ein, kein, mein, ...) and the three adjective
# declensions, by case and by gender or plural ("m", "f", "n", "pl").
def _table(rows: str) -> dict:
    return {case: dict(zip(("m", "f", "n", "pl"), (e.replace("_", "") for e in row.split())))
            for case, row in zip(CASES, rows.strip().split("|"))}


DEF_ART = _table("der die das die | den die das die | dem der dem den | des der des der")
DIESER = _table("dieser diese dieses diese | diesen diese dieses diese | diesem dieser diesem diesen |"
                "dieses dieser dieses dieser")
EIN_END = _table("_ e _ e | en e _ e | em er em en | es er es er")
STRONG = _table("er e es e | en e es e | em er em en | en er en er")
WEAK = _table("e e e en | en e e en | en en en en | en en en en")
MIXED = _table("er e es en | en e es en | en en en en | en en en en")
RELATIVE = _table("der die das die | den die das die | dem der dem denen | dessen deren dessen deren")

# =====================================================================================================
# Sentence trees
# =====================================================================================================


@dataclass
class NP:
    noun: Noun | None = None
    name: str | None = None
    pron: str | None = None  # a key of PRONOUNS
    conj: tuple["NP", ...] = ()  # coordinated subjects: "the dog and the cat"
    plural: bool = False
    det: str = "the"  # the | a | this | poss | num | many | bare | gen (the man's) | name_gen (Anna's)
    word: str = ""  # the possessive ("my") or the number ("two")
    possessor: "NP | None" = None
    adj: Adj | None = None
    pp: "PP | None" = None
    rel: "Clause | None" = None

    @property
    def agr(self) -> str:
        if self.pron:
            return PRONOUNS[self.pron][5]
        return "pl" if self.conj or self.plural else "sg3"

    @property
    def key(self) -> str:  # the column of the declension tables
        return "pl" if self.plural else self.noun.gender

    @property
    def all_animals(self) -> bool:
        parts = self.conj or (self,)
        return all(p.noun is not None and p.noun.kind == "animal" for p in parts)


@dataclass
class PP:
    prep: Prep
    np: NP


@dataclass
class Clause:
    subj: NP | None  # None: the relativized subject, or "who" in a question
    verb: Verb | None  # None: the copula
    tense: str  # present | past | future | can | must | want
    neg: bool = False
    io: NP | None = None
    obj: NP | None = None  # None for a relativized or questioned object
    pred: Adj | PP | None = None  # the copula's predicate
    pps: tuple[PP, ...] = ()
    adv: Adverb | None = None
    front: bool = False  # the time adverb is fronted
    sub: tuple[str, "Clause", bool] | None = None  # adverbial clause: (conjunction, clause, fronted)
    comp: tuple[str, "Clause"] | None = None  # complement clause of a frame C verb: (that|whether, clause)
    head: NP | None = None  # relative clauses: the noun phrase modified
    gap: str | None = None  # relative clauses: "subj" | "obj"
    wh: str | None = None  # questions: subj | obj | where | why | when

    @property
    def agr(self) -> str:
        if self.gap == "subj":
            return self.head.agr
        return "sg3" if self.wh == "subj" else self.subj.agr

    @property
    def obj_case(self) -> str:
        return "dat" if self.verb is not None and self.verb.frame == "D" else "acc"

    @property
    def kein(self) -> bool:  # "not ... a dog" → "keinen Hund" instead of nicht
        o = self.obj
        return self.neg and o is not None and o.noun is not None and o.det in ("a", "bare")


# =====================================================================================================
# English
# =====================================================================================================


def _article(next_word: str) -> str:
    return "an" if next_word[0] in "aeiou" else "a"


def _en_np(np: NP, role: str) -> list[str]:
    """role: "subj" | "obj" (pronoun form); a relative clause follows its head."""
    if np.conj:
        return [*_en_np(np.conj[0], role), "and", *_en_np(np.conj[1], role)]
    if np.pron:
        return [PRONOUNS[np.pron][0 if role == "subj" else 1]]
    if np.name:
        return [np.name]
    words = [np.adj.en] if np.adj else []
    words.append(np.noun.en_pl if np.plural else np.noun.en)
    det = {"the": ["the"], "a": [_article(words[0])], "this": ["these" if np.plural else "this"],
           "poss": [np.word], "num": [np.word], "many": ["many"], "bare": []}.get(np.det)
    if det is None:  # a possessor: "the old man's", "Anna's"
        *det, last = _en_np(np.possessor, "subj")
        det.append(last + "'s")
    out = det + words
    if np.pp:
        out += _en_pp(np.pp)
    if np.rel:
        out += _en_clause(np.rel, "rel")
    return out


def _en_pp(pp: PP) -> list[str]:
    return [*pp.prep.en.split(), *_en_np(pp.np, "obj")]


def _en_verb(c: Clause, inverted: bool) -> tuple[list[str], list[str]]:
    """The verb group as (the auxiliary before the subject, the rest): ([], ["often", "sees"]),
    (["does"], ["see"]) in a question, ([], ["did", "not", "see"])."""
    agr, adv = c.agr, ([c.adv.en] if c.adv and c.adv.kind == "freq" else [])
    neg = ["not"] if c.neg else []
    if c.verb is None:
        if c.tense == "future":
            aux, rest = "will", neg + adv + ["be"]
        else:
            aux, rest = BE_EN[c.tense][agr], neg + adv
        return ([aux], rest) if inverted else ([], [aux, *rest])
    v = c.verb
    base = [v.en, v.en_particle] if v.en_particle else [v.en]
    do = {"present": "does" if agr == "sg3" else "do", "past": "did"}
    if c.tense in ("present", "past"):
        if c.neg or inverted:
            aux, rest = do[c.tense], neg + adv + base
        else:
            finite = v.en_past if c.tense == "past" else (v.en_3sg() if agr == "sg3" else v.en)
            return [], adv + [finite, *base[1:]]
    elif c.tense == "want":
        want = ["want", "to", *base]
        if c.neg or inverted:
            aux, rest = do["present"], neg + adv + want
        else:
            return [], adv + ["wants" if agr == "sg3" else "want", *want[1:]]
    elif c.tense == "can" and c.neg:
        aux, rest = "cannot", base
    else:
        aux, rest = {"future": "will", "can": "can", "must": "must"}[c.tense], neg + adv + base
    return ([aux], rest) if inverted else ([], [aux, *rest])


def _en_clause(c: Clause, mode: str) -> list[str]:
    """mode: main | sub | rel | yn (yes/no question) | wh."""
    inverted = mode == "yn" or (mode == "wh" and c.wh != "subj")
    aux, verb = _en_verb(c, inverted)
    tail = []
    if c.io:
        tail += _en_np(c.io, "obj")
    if c.obj:
        tail += _en_np(c.obj, "obj")
    for pp in c.pps:
        tail += _en_pp(pp)
    if isinstance(c.pred, Adj):
        tail.append(c.pred.en)
    elif c.pred is not None:
        tail += _en_pp(c.pred)
    if c.adv and c.adv.kind == "time" and not c.front:
        tail += c.adv.en.split()
    subj = _en_np(c.subj, "subj") if c.subj else []
    if mode == "main":
        if c.front:
            head = c.adv.en.split()
        elif c.sub and c.sub[2]:
            head = [c.sub[0], *_en_clause(c.sub[1], "sub"), ","]
        else:
            head = []
        out = head + subj + verb + tail
    elif mode == "sub":
        out = subj + verb + tail
    elif mode == "rel":
        who = "who" if c.gap == "subj" and c.head.noun.kind == "person" else "that"
        out = [who] + subj + verb + tail
    elif mode == "yn":
        out = aux + subj + verb + tail
    else:
        what = "who" if c.wh == "subj" else _en_wh(c)
        out = [what] + aux + subj + verb + tail
    if c.comp:
        out += [c.comp[0], *_en_clause(c.comp[1], "sub")]
    if c.sub and not c.sub[2]:
        out += [c.sub[0], *_en_clause(c.sub[1], "sub")]
    return out


def _en_wh(c: Clause) -> str:
    if c.wh == "obj":
        return "who" if c.head.noun.kind == "person" else "what"  # `head` holds the questioned object's noun
    return c.wh


# =====================================================================================================
# German
# =====================================================================================================


def _de_np(np: NP, case: str, *, kein: bool = False) -> list[str]:
    """A noun phrase in `case`; relative clauses are placed by the clause (they may be extraposed)."""
    if np.conj:
        return [*_de_np(np.conj[0], case), "und", *_de_np(np.conj[1], case)]
    if np.pron:
        return [PRONOUNS[np.pron][{"nom": 2, "acc": 3, "dat": 4}[case]]]
    if np.name:
        return [np.name]
    key, det = np.key, np.det
    if kein:
        words, decl = ["kein" + EIN_END[case][key]], MIXED
    elif det in ("the", "gen"):
        words, decl = [DEF_ART[case][key]], WEAK
    elif det == "this":
        words, decl = [DIESER[case][key]], WEAK
    elif det == "a":
        words, decl = ["ein" + EIN_END[case][key]], MIXED
    elif det == "poss":
        words, decl = [POSSESSIVES[np.word] + EIN_END[case][key]], MIXED
    elif det == "num":
        words, decl = [NUMBERS[np.word]], STRONG
    elif det == "many":
        words, decl = ["viel" + STRONG[case]["pl"]], STRONG
    elif det == "name_gen":
        words, decl = [np.possessor.name + "s"], STRONG  # Annas großer Hund
    else:  # bare plural
        words, decl = [], STRONG
    if np.adj:
        words.append(np.adj.stem + decl[case][key])
    words.append(np.noun.de_form(case, np.plural))
    if det == "gen":
        words += _de_np(np.possessor, "gen")  # der Hund des alten Mannes
    if np.pp:
        words += _de_pp(np.pp)
    return words


def _de_pp(pp: PP) -> list[str]:
    words = _de_np(pp.np, pp.prep.case)
    short = CONTRACTIONS.get((pp.prep.de, words[0]))
    if short and pp.np.det in ("the", "gen"):
        return [short, *words[1:]]
    return [pp.prep.de, *words]


def _de_verb(c: Clause, sub: bool) -> tuple[str, list[str]]:
    """The finite verb and the verb bracket's right part: ("hat", ["gesehen"]), ("ruft", ["an"]);
    in a subordinate clause a separable verb joins up again ("anruft")."""
    agr = c.agr
    if c.verb is None:
        if c.tense == "future":
            return WERDEN[agr], ["sein"]
        return (WAR if c.tense == "past" else SEIN)[agr], []
    v = c.verb.animal if c.verb.animal and _subject_is_animal(c) else c.verb
    if c.tense == "present":
        if v.de_prefix:
            return (v.de_prefix + v.de_forms[agr], []) if sub else (v.de_forms[agr], [v.de_prefix])
        return v.de_forms[agr], []
    if c.tense == "past":
        return (HABEN if v.de_aux == "haben" else SEIN)[agr], [v.de_part]
    if c.tense == "future":
        return WERDEN[agr], [v.de_inf]
    modal = "must_not" if c.tense == "must" and c.neg else c.tense
    return MODALS[modal][agr], [v.de_inf]


def _subject_is_animal(c: Clause) -> bool:
    if c.gap == "subj":
        return c.head.all_animals
    return c.subj is not None and c.subj.all_animals


def _de_middle(c: Clause, with_subject: bool) -> list[str]:
    """The middle field: subject, pronoun objects, adverb, dative and accusative noun phrases, nicht,
    prepositional phrases, the copula's predicate."""
    out = _de_np(c.subj, "nom") if with_subject and c.subj else []
    objects = [(np, case) for np, case in ((c.io, "dat"), (c.obj, c.obj_case)) if np is not None]
    out += [w for np, case in objects if np.pron for w in _de_np(np, case)]
    if c.adv and not c.front:
        out += c.adv.de.split()
    out += [w for np, case in objects if not np.pron for w in _de_np(np, case, kein=np is c.obj and c.kein)]
    if c.neg and not c.kein:
        out.append("nicht")
    for pp in c.pps:
        out += _de_pp(pp)
    if isinstance(c.pred, Adj):
        out.append(c.pred.de)
    elif c.pred is not None:
        out += _de_pp(c.pred)
    return out


def _de_clause(c: Clause, mode: str) -> list[str]:
    """mode: main (verb second) | sub, rel (verb last) | yn (verb first) | wh."""
    finite, right = _de_verb(c, sub=mode in ("sub", "rel"))
    if mode == "main":
        if c.front:
            out = [*c.adv.de.split(), finite, *_de_middle(c, True), *right]
        elif c.sub and c.sub[2]:
            out = [*_de_sub(c.sub), ",", finite, *_de_middle(c, True), *right]
        else:
            subj = _de_np(c.subj, "nom")
            if c.subj.rel:
                subj += [",", *_de_clause(c.subj.rel, "rel"), ","]
            out = [*subj, finite, *_de_middle(c, False), *right]
    elif mode == "sub":
        out = [*_de_middle(c, True), *right, finite]
    elif mode == "rel":
        case = "nom" if c.gap == "subj" else c.obj_case
        out = [RELATIVE[case][c.head.key], *_de_middle(c, True), *right, finite]
    elif mode == "yn":
        out = [finite, *_de_middle(c, True), *right]
    else:
        out = [_de_wh(c), finite, *_de_middle(c, True), *right]
    if c.obj is not None and c.obj.rel:  # extraposed behind the verb bracket
        out += [",", *_de_clause(c.obj.rel, "rel")]
    if c.comp:
        out += [",", COMPLEMENTIZERS[c.comp[0]], *_de_clause(c.comp[1], "sub")]
    if c.sub and not c.sub[2]:
        out += [",", *_de_sub(c.sub)]
    return out


def _de_sub(sub: tuple[str, Clause, bool]) -> list[str]:
    conj, clause, _ = sub
    word = "als" if conj == "when" and clause.tense == "past" else SUBORDINATORS[conj][0]
    return [word, *_de_clause(clause, "sub")]


def _de_wh(c: Clause) -> str:
    if c.wh == "subj":
        return "wer"
    if c.wh == "obj":
        if c.head.noun.kind != "person":
            return "was"
        return "wem" if c.obj_case == "dat" else "wen"
    return WH_WORDS[c.wh]


def _clash(np: NP | None, subj_pron: str | None) -> bool:
    """A pronoun that would need a reflexive: "I see me", "we play with us"."""
    if np is None or np.pron is None or subj_pron is None:
        return False
    return np.pron == subj_pron or {np.pron, subj_pron} == {"I", "we"}


def _sentence_text(words: list[str], end: str) -> str:
    text = " ".join(words).replace(" ,", ",") + end
    return text[0].upper() + text[1:]


# =====================================================================================================
# The generator
# =====================================================================================================

# Shares of sentence types, tenses and optional parts: tuned so that a 2-3 layer model learns every
# phenomenon from ~30k sentences in minutes.
SENTENCE_TYPES = {"simple": 30, "complement": 9, "adverbial": 12, "rel_subj": 8, "rel_obj": 8, "yn": 10,
                  "wh": 11, "coord": 8}
TENSES = {"present": 36, "past": 30, "future": 12, "can": 8, "must": 6, "want": 8}
COPULA_TENSES = {"present": 5, "past": 3, "future": 2}
FRAMES = {"I": 30, "T": 45, "D": 10, "G": 15}
P_COPULA, P_NEG, P_ADV, P_FRONT, P_ADJ = 0.15, 0.18, 0.3, 0.35, 0.2
PP_COUNTS = {0: 65, 1: 30, 2: 5}  # prepositional phrases on a clause
SG_DETS = {"the": 52, "a": 20, "this": 6, "poss": 10, "gen": 6, "name_gen": 4}
PL_DETS = {"the": 40, "bare": 15, "this": 7, "poss": 10, "num": 14, "many": 6, "gen": 5, "name_gen": 3}


class _Generator:
    """Draws sentence trees from one seeded random stream (only lists and tuples are sampled, never
    sets: their order depends on the process's hash seed)."""

    def __init__(self, seed: int):
        self.r = random.Random(seed)

    def pick(self, weights: dict):
        return self.r.choices(list(weights), weights=list(weights.values()))[0]

    def chance(self, p: float) -> bool:
        return self.r.random() < p

    # ---- noun phrases -------------------------------------------------------------------------------

    def np(self, nouns: tuple[Noun, ...], *, pron: float = 0.0, name: float = 0.0, pp: float = 0.0,
           definite: bool = False, simple: bool = False, plural: float = 0.3) -> NP:
        """A noun phrase over `nouns`; pron/name: chances of a pronoun or a name (for people only);
        definite: an indirect object (no "a", numbers, ...); simple: no possessor."""
        r = self.r
        people = any(n.kind == "person" for n in nouns)
        x = r.random()
        if x < pron:
            if people:
                return NP(pron=r.choice(("I", "he", "she", "we", "they")))
            return NP(pron=r.choice(("it", "they")))
        if people and x < pron + name:
            return NP(name=r.choice(NAMES))
        noun = r.choice(nouns)
        pl = not noun.mass and self.chance(plural)
        dets = dict(PL_DETS if pl else SG_DETS)
        if noun.mass:
            dets.pop("a")
        if definite:
            for d in ("a", "bare", "num", "many"):
                dets.pop(d, None)
        if simple:
            dets.pop("gen")
            dets.pop("name_gen")
        out = NP(noun=noun, plural=pl, det=self.pick(dets))
        if out.det == "poss":
            out.word = r.choice(tuple(POSSESSIVES))
        elif out.det == "num":
            out.word = r.choice(tuple(NUMBERS))
        elif out.det == "gen":
            possessor = r.choice(tuple(n for n in NOUNS if n.animate and n is not noun))
            out.possessor = NP(noun=possessor, adj=r.choice(ADJ_BY_KIND[possessor.kind]) if self.chance(.2)
                               else None)
        elif out.det == "name_gen":
            out.possessor = NP(name=r.choice(NAMES))
        if self.chance(P_ADJ):
            out.adj = r.choice(ADJ_BY_KIND[noun.kind])
        if pp and self.chance(pp) and noun.kind not in ("place", "fixture"):
            out.pp = self.place_pp()
        return out

    def place_pp(self, roles: tuple[str, ...] = ("loc",)) -> PP:
        key = self.r.choice(tuple(k for k, p in PREPS.items() if p.role in roles and k in PLACES))
        place = NP(noun=self.r.choice(PLACES[key]), det=self.pick({"the": 70, "a": 12, "this": 6, "poss": 12}))
        if place.det == "poss":
            place.word = self.r.choice(tuple(POSSESSIVES))
        if self.chance(0.15):
            place.adj = self.r.choice(ADJ_BY_KIND[place.noun.kind])
        return PP(PREPS[key], place)

    def subject(self, kinds: tuple[str, ...], *, coord: float = 0.05, pp: float = 0.08) -> NP:
        nouns = tuple(n for n in NOUNS if n.kind in kinds)
        if self.chance(coord):  # "the dog and the cat": both of one kind, so a predicate fits both
            kind = self.r.choice(nouns).kind
            parts = tuple(self.np(tuple(n for n in nouns if n.kind == kind), name=0.25, simple=True, plural=0.0)
                          for _ in range(2))
            if _en_np(parts[0], "subj") != _en_np(parts[1], "subj"):
                return NP(conj=parts)
        return self.np(nouns, pron=0.2 if "person" in kinds else 0.0, name=0.15, pp=pp)

    # ---- clauses -----------------------------------------------------------------------------------

    def verb(self, *, frame: str | None = None, subj_kind: str | None = None, obj: Noun | None = None) -> Verb:
        if frame is None:
            frame = self.pick({f: w for f, w in FRAMES.items() if obj is None or f in "TD"})
        choices = tuple(v for v in VERBS if v.frame == frame and (subj_kind is None or subj_kind in v.subj)
                        and (obj is None or obj in v.objects))
        if not choices:  # e.g. no verb of this frame takes this object: another frame
            return self.verb(subj_kind=subj_kind, obj=obj)
        return self.r.choice(choices)

    def clause(self, *, frame: str | None = None, gap: str | None = None, head: NP | None = None,
               wh: str | None = None, tail: bool = True, front: bool = False, neg: bool = True,
               tenses: tuple[str, ...] = _ALL_TENSES, rel: str | None = None) -> Clause:
        """tail: the clause may end in prepositional phrases and a time adverb (in English nothing may
        follow a relative or complement clause but that clause); front: a time adverb may be fronted;
        rel: "subj" | "obj", put a relative clause on the subject or the object."""
        r = self.r
        head_kind = head.noun.kind if head is not None and head.noun is not None else None
        copula = frame is None and gap != "obj" and wh != "obj" and rel != "obj" and self.chance(P_COPULA)
        if copula:
            verb = None
            tense = self.pick({t: w for t, w in COPULA_TENSES.items() if t in tenses})
        else:
            if gap == "subj":
                if not any(head_kind in v.subj for v in VERBS if v.frame != "C"):
                    return self.copula(head, tenses)
                verb = self.verb(frame=frame, subj_kind=head_kind)
            elif gap == "obj":
                verb = self.verb(obj=head.noun)
            elif wh == "subj":
                verb = self.verb(frame=frame, subj_kind="person")
            elif wh == "obj":
                verb = self.verb(frame=self.pick({"T": 3, "D": 1}))
            else:
                verb = self.verb(frame=frame)
            tense = self.pick({t: w for t, w in TENSES.items() if t in tenses})
        subj_kinds = verb.subj if verb else KINDS
        if gap == "subj" or wh == "subj":
            subj = None
        elif rel == "subj":
            subj = self.np(tuple(n for n in NOUNS if n.kind in subj_kinds), simple=True)
        else:
            subj = self.subject(subj_kinds, coord=0.05 if gap is None else 0.0)
        c = Clause(subj=subj, verb=verb, tense=tense, head=head, gap=gap, wh=wh)
        if rel == "subj":
            c.subj.rel = self.clause(gap=self.pick({"subj": 3, "obj": 2}), head=c.subj)
        if verb is None:
            self.predicate(c)
        else:
            self.objects(c, rel=rel)
        if c.obj is not None and c.obj.det in ("num", "many") or wh is not None:
            neg = False
        if self.chance(P_ADV):
            advs = tuple(a for a in ADVERBS if tense in a.tenses and (a.kind == "freq" or tail or front))
            c.adv = r.choice(advs)
            c.front = c.adv.kind == "time" and front and (not tail or self.chance(P_FRONT))
        elif neg and self.chance(P_NEG):
            c.neg = True
        if tail and verb is not None:
            c.pps = self.pps(c)
        return c

    def copula(self, head: NP, tenses: tuple[str, ...]) -> Clause:
        c = Clause(subj=None, verb=None, tense=self.pick({t: w for t, w in COPULA_TENSES.items() if t in tenses}),
                   head=head, gap="subj")
        self.predicate(c)
        return c

    def predicate(self, c: Clause) -> None:
        if c.wh == "where":
            return  # "Where is the dog?"
        subj = c.head if c.gap == "subj" else c.subj
        if subj is not None and subj.conj and subj.conj[0].noun is not None:
            kind = subj.conj[0].noun.kind
        elif subj is not None and subj.noun is not None:
            kind = subj.noun.kind
        elif subj is not None and subj.pron == "it":
            kind = "thing"
        else:
            kind = "person"
        if kind in ("place", "fixture") or self.chance(0.7):
            c.pred = self.r.choice(tuple(a for a in ADJ_BY_KIND[kind] if subj is None or a is not subj.adj))
        else:
            c.pred = self.place_pp()

    def objects(self, c: Clause, rel: str | None) -> None:
        v, r = c.verb, self.r
        subj_pron = c.subj.pron if c.subj is not None else None
        if v.frame == "G":
            c.io = self.np(v.io, pron=0.2, name=0.15, definite=True, simple=True, plural=0.2)
            if _clash(c.io, subj_pron):
                c.io = NP(name=r.choice(NAMES))  # no reflexives: "I give me the ball" is not English
        if v.frame in "TDG" and c.gap != "obj" and c.wh != "obj":
            pron = 0.15 if v.frame in "TD" and rel != "obj" else 0.0
            c.obj = self.np(v.objects, pron=pron, name=0.12 if rel != "obj" else 0.0, simple=rel == "obj")
            if _clash(c.obj, subj_pron):
                c.obj = NP(noun=r.choice(v.objects))
            if rel == "obj" and c.obj.noun is not None:
                c.obj.rel = self.clause(gap=self.pick({"subj": 1, "obj": 1}), head=c.obj)
        if c.wh == "obj":  # the questioned object: its noun decides who/what and wen/wem/was
            c.head = NP(noun=r.choice(tuple(n for n in v.objects if v.frame == "T" or n.kind == "person")))
        if v.frame == "C":
            word = r.choice(v.comp)
            c.comp = (word, self.clause())

    def pps(self, c: Clause) -> tuple[PP, ...]:
        v = c.verb
        roles = [] if c.wh == "where" or v.de_inf.endswith("kommen") else ["loc"]  # not "comes in the shop"
        if v.motion:
            roles.append("path")
        if v.frame in "IT":
            roles.append("with")
            if "person" in v.subj and v.en_particle != "for":
                roles.append("for")
        n = self.pick(PP_COUNTS)
        if n == 0 or not roles:
            return ()
        chosen = [self.r.choice(roles)]
        if n == 2 and chosen[0] in ("with", "for") and "loc" in roles:
            chosen.append("loc")
        out = []
        for role in chosen:
            if role in ("loc", "path"):
                out.append(self.place_pp((role,)))
            else:
                key = self.r.choice(("with", "without") if role == "with" else ("for",))
                nouns = COMPANIONS if key == "with" else tuple(n for n in NOUNS if n.animate)
                np = self.np(nouns, pron=0.15, name=0.15, simple=True, plural=0.15)
                if _clash(np, c.subj.pron if c.subj is not None else None):
                    np = NP(name=self.r.choice(NAMES))
                out.append(PP(PREPS[key], np))
        return tuple(out)

    # ---- sentences ---------------------------------------------------------------------------------

    def pair(self) -> tuple[str, str]:
        while True:
            en, de = self.attempt()
            if MIN_WORDS <= len(en.split()) <= MAX_WORDS:
                return en, de

    def attempt(self) -> tuple[str, str]:
        kind = self.pick(SENTENCE_TYPES)
        end = "."
        if kind == "simple":
            c = self.clause(front=True)
            en, de = _en_clause(c, "main"), _de_clause(c, "main")
        elif kind == "complement":
            c = self.clause(frame="C", front=True, tail=False)
            en, de = _en_clause(c, "main"), _de_clause(c, "main")
        elif kind == "adverbial":
            conj = self.r.choice(tuple(SUBORDINATORS))
            fronted = self.chance(0.4)
            c = self.clause(front=not fronted)
            c.sub = (conj, self.clause(tenses=SUBORDINATORS[conj][1]), fronted)
            en, de = _en_clause(c, "main"), _de_clause(c, "main")
        elif kind == "rel_subj":
            c = self.clause(rel="subj")
            en, de = _en_clause(c, "main"), _de_clause(c, "main")
        elif kind == "rel_obj":
            c = self.clause(frame=self.pick({"T": 6, "D": 1, "G": 2}), rel="obj", front=True, tail=False)
            en, de = _en_clause(c, "main"), _de_clause(c, "main")
        elif kind == "yn":
            c = self.clause(neg=False)
            en, de, end = _en_clause(c, "yn"), _de_clause(c, "yn"), "?"
        elif kind == "wh":
            c = self.clause(wh=self.pick({"subj": 3, "obj": 3, "where": 2, "why": 1, "when": 1}))
            en, de, end = _en_clause(c, "wh"), _de_clause(c, "wh"), "?"
        else:
            joiner = self.r.choice(("and", "but"))
            c1, c2 = self.clause(front=True), self.clause(front=True)
            en = [*_en_clause(c1, "main"), joiner, *_en_clause(c2, "main")]
            de = [*_de_clause(c1, "main"), *([","] if joiner == "but" else []), "und" if joiner == "and"
                  else "aber", *_de_clause(c2, "main")]
        return _sentence_text(en, end), _sentence_text(de, end)


# =====================================================================================================
# The corpus
# =====================================================================================================


def generate(n: int, seed: int) -> list[tuple[str, str]]:
    """`n` (English, German) pairs with distinct English sides, a function of (n, seed); the first k
    pairs of generate(n, seed) are generate(k, seed)."""
    gen, seen, out = _Generator(seed), set(), []
    draws = 0
    while len(out) < n:
        draws += 1
        if draws > 20 * n + 1000:
            raise ValueError(f"the grammar does not yield {n} distinct sentences (got {len(out)})")
        en, de = gen.pair()
        if en not in seen:
            seen.add(en)
            out.append((en, de))
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_corpus(out_dir: Path, *, train: int = DEFAULT_SIZES["train"], valid: int = DEFAULT_SIZES["valid"],
                 test: int = DEFAULT_SIZES["test"], seed: int = 1) -> dict[str, Path]:
    """Write `{train,valid,test}.{en,de}` (UTF-8, one sentence a line) under `out_dir` and return the
    prefixes {"train": out_dir/"train", ...}. Test and valid are the first sentences drawn, so they do
    not depend on the training size, and no source sentence occurs in two splits. Files already written
    with the same parameters and unchanged content (checked against `synthetic.json`) are left alone."""
    out_dir = Path(out_dir)
    sizes = {"train": train, "valid": valid, "test": test}
    if any(v < 0 for v in sizes.values()):
        raise ValueError(f"split sizes must be >= 0, got {sizes}")
    prefixes = {split: out_dir / split for split in sizes}
    params = {"grammar_version": GRAMMAR_VERSION, "seed": seed, "sizes": sizes}
    manifest = out_dir / "synthetic.json"
    files = [prefixes[s].with_suffix(f".{lang}") for s in sizes for lang in (SRC_LANG, TGT_LANG)]
    if manifest.exists() and all(f.exists() for f in files):
        try:
            old = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            old = {}
        if old.get("params") == params and old.get("sha256") == {f.name: _sha256(f) for f in files}:
            log.info("synthetic corpus up to date in %s", out_dir)
            return prefixes
    pairs = generate(test + valid + train, seed)
    bounds = {"test": (0, test), "valid": (test, test + valid), "train": (test + valid, test + valid + train)}
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, (a, b) in bounds.items():
        for side, lang in enumerate((SRC_LANG, TGT_LANG)):
            atomic_write(prefixes[split].with_suffix(f".{lang}"), "".join(p[side] + "\n" for p in pairs[a:b]))
    atomic_write(manifest, json.dumps({"params": params, "sha256": {f.name: _sha256(f) for f in files}},
                                       indent=2) + "\n")
    log.info("wrote a synthetic corpus to %s: %s", out_dir, sizes)
    return prefixes




def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quickstart.corpus", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path, help="directory for train/valid/test .en/.de")
    for split, size in DEFAULT_SIZES.items():
        parser.add_argument(f"--{split}", type=int, default=size, help=f"pairs in {split} [{size}]")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    prefixes = write_corpus(args.out_dir, train=args.train, valid=args.valid, test=args.test, seed=args.seed)
    for split, prefix in prefixes.items():
        print(f"{split}: {prefix}.{SRC_LANG} {prefix}.{TGT_LANG}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

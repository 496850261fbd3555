"""analyze_csv on files as spreadsheets and data portals write them: encodings and compression,
through the real server, against pandas on the host reading the same bytes with the right settings."""

from __future__ import annotations

import gzip
import io
import random
import unicodedata
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from mcp import Client

from tests.mcp_harness import text_of, upload

pytestmark = pytest.mark.anyio

TONES = "\u0300\u0301\u0303\u0309\u0323"


def _vietnamese(*words: str) -> list[str]:
    """Words as Windows-1258 writes them: a letter with its vowel mark (â, ư, ơ...) and the tone as a separate
    combining mark (that code page has no letters carrying both)."""
    written = []
    for word in words:
        letters = []
        for char in word:
            parts = unicodedata.normalize("NFD", char)
            tones = "".join(mark for mark in parts if mark in TONES)
            base = unicodedata.normalize("NFC", "".join(mark for mark in parts if mark not in TONES))
            letters.append(char if _encodes(char, "cp1258") else base + tones)
        written.append("".join(letters))
    return written


def _encodes(text: str, codec: str) -> bool:
    try:
        text.encode(codec)
    except UnicodeEncodeError:
        return False
    return True


# Each case: headers and group values in the encoding's own script, and the codec names a detector
# may fairly report for such bytes (GBK is read as its superset GB18030; Big5 as Big5 or its Windows form).
CASES = {
    "gb18030": (["地区", "金额", "备注"], ["华东", "华南", "西北", "东北"],
                ["按时交货", "客户满意", "需要跟进", "已经付款", "退货处理中"], {"gb18030"}),
    "big5": (["地區", "金額", "備註"], ["臺北", "高雄", "臺中", "花蓮"],
             ["準時交貨", "客戶滿意", "需要跟進", "已經付款", "退貨處理中"], {"big5", "cp950", "big5hkscs"}),
    "shift_jis": (["地域", "金額", "備考"], ["東京", "大阪", "名古屋", "札幌"],
                  ["予定通りに納品しました", "お客様は満足しています", "確認が必要です", "支払い済みです",
                   "返品の処理中です"], {"shift_jis", "cp932"}),
    "euc_kr": (["지역", "금액", "비고"], ["서울", "부산", "대구", "인천"],
               ["제때 배송되었습니다", "고객이 만족합니다", "확인이 필요합니다", "결제 완료", "반품 처리 중"],
               {"euc_kr", "cp949"}),
    "cp1252": (["Région", "Montant", "Remarque"], ["Île-de-France", "Provence-Côte", "Bourgogne", "Hauts-de-Seine"],
               ["livré à l'heure", "client très satisfait", "à vérifier – relancer", "payé €", "retour en cours"],
               {"cp1252", "iso8859_15"}),
    "euc_jp": (["地域", "金額", "備考"], ["東京", "大阪", "名古屋", "札幌"],
               ["予定通りに納品しました", "お客様は満足しています", "確認が必要です", "支払い済みです",
                "返品の処理中です"], {"euc_jp", "euc_jis_2004", "euc_jisx0213"}),
    "cp1251": (["Регион", "Сумма", "Примечание"], ["Москва", "Казань", "Новосибирск", "Екатеринбург"],
               ["доставлено вовремя", "клиент доволен", "требует проверки", "оплачено", "возврат в обработке"],
               {"cp1251"}),
    "cp1253": (["Περιοχή", "Ποσό", "Σημείωση"], ["Αθήνα", "Θεσσαλονίκη", "Πάτρα", "Ηράκλειο"],
               ["παραδόθηκε εγκαίρως", "ο πελάτης είναι ικανοποιημένος", "χρειάζεται έλεγχο", "πληρώθηκε",
                "επιστροφή σε εξέλιξη"], {"cp1253"}),
    "cp1254": (["Bölge", "Tutar", "Not"], ["İstanbul", "Ankara", "İzmir", "Eskişehir"],
               ["zamanında teslim edildi", "müşteri memnun", "kontrol gerekiyor", "ödendi", "iade işleniyor"],
               {"cp1254"}),
    "cp1255": (["אזור", "סכום", "הערה"], ["ירושלים", "תל אביב", "חיפה", "באר שבע"],
               ["נמסר בזמן", "הלקוח מרוצה", "דורש בדיקה", "שולם", "החזרה בטיפול"], {"cp1255", "iso8859_8"}),
    "cp1256": (["المنطقة", "المبلغ", "ملاحظة"], ["القاهرة", "الرياض", "دبي", "عمان"],
               ["تم التسليم في الموعد", "العميل راض", "يحتاج إلى مراجعة", "تم الدفع", "الإرجاع قيد المعالجة"],
               {"cp1256"}),
    "cp1257": (["Regionas", "Suma", "Pastaba"], ["Vilnius", "Kaunas", "Klaipėda", "Šiauliai"],
               ["pristatyta laiku", "klientas patenkintas", "reikia patikrinti", "apmokėta", "grąžinimas vykdomas"],
               {"cp1257", "iso8859_13"}),
    "cp1258": (_vietnamese("Khu vực", "Số tiền", "Ghi chú"), _vietnamese("Hà Nội", "Đà Nẵng", "Huế", "Cần Thơ"),
               _vietnamese("giao đúng hẹn", "khách hàng hài lòng", "cần kiểm tra", "đã thanh toán",
                           "đang xử lý trả hàng"), {"cp1258"}),
    "cp1250": (["Województwo", "Kwota", "Uwagi"], ["Łódzkie", "Śląskie", "Małopolskie", "Świętokrzyskie"],
               ["dostarczono na czas", "klient zadowolony", "wymaga sprawdzenia", "zapłacono", "zwrot w toku"],
               {"cp1250", "iso8859_2"}),
}  # fmt: skip


def _table(codec: str, rows: int = 300, seed: int = 3) -> str:
    """A small table in the case's own script: a group, an amount and a free-text remark per row."""
    headers, groups, remarks, _ = CASES[codec]
    rng = random.Random(seed)
    lines = [",".join(headers)]
    lines += [f"{rng.choice(groups)},{rng.randint(-500, 5000) / 4},{rng.choice(remarks)}" for _ in range(rows)]
    return "\n".join(lines) + "\n"


async def _analyze(module_session: Client, arguments: dict[str, Any]) -> dict[str, Any]:
    result = await module_session.call_tool("analyze_csv", arguments)
    assert not result.is_error, text_of(result)
    assert result.structured_content is not None
    return dict(result.structured_content)


def _sums_by_group(answer: dict[str, Any], group: str, column: str) -> dict[str, float]:
    return {entry["group"][group]: entry["columns"][column]["sum"] for entry in answer["results"]}


@pytest.mark.parametrize("codec", list(CASES))
async def test_a_file_in_its_own_encoding_answers_what_pandas_reads(
    module_session: Client, tmp_path: Path, codec: str
) -> None:
    headers, _, _, fair = CASES[codec]
    data = _table(codec).encode(codec)
    answer = await _analyze(module_session, {
        "filepath": "local.csv", "operations": ["sum", "count"], "group_by": [headers[0]],
        "files": upload("local.csv", data),
    })  # fmt: skip
    (tmp_path / "local.csv").write_bytes(data)
    frame = pd.read_csv(tmp_path / "local.csv", encoding=codec)
    expected = frame.groupby(headers[0])[headers[1]].sum().to_dict()
    assert [column["name"] for column in answer["file"]["columns"]] == headers  # in their own script
    assert _sums_by_group(answer, headers[0], headers[1]) == pytest.approx(expected)
    reported = answer["file"]["encoding"].split(" ", 1)[0].lower().replace("-", "_")
    assert reported in fair, answer["file"]["encoding"]
    assert "sure" in answer["file"]["encoding"], "a detected encoding says how sure the detector is"


async def test_an_encoding_given_overrides_detection(module_session: Client) -> None:
    data = _table("gb18030").encode("gb18030")
    answer = await _analyze(module_session, {
        "filepath": "given.csv", "operations": ["sum"], "encoding": "gb18030", "files": upload("given.csv", data),
    })  # fmt: skip
    assert answer["file"]["encoding"] == "gb18030 (as asked)"
    unknown = await module_session.call_tool(
        "analyze_csv",
        {"filepath": "given.csv", "operations": ["sum"], "encoding": "klingon", "files": upload("given.csv", data)},
    )
    assert unknown.is_error and "encoding 'klingon' is not an encoding" in text_of(unknown), text_of(unknown)


async def test_a_file_that_changes_encoding_is_refused_naming_the_line(module_session: Client) -> None:
    lines = _table("gb18030").encode("gb18030").split(b"\n")
    lines[150] = b"\xff\xfe" + lines[150]  # never valid GB18030
    result = await module_session.call_tool("analyze_csv", {
        "filepath": "mixed.csv", "operations": ["sum"], "encoding": "gb18030",
        "files": upload("mixed.csv", b"\n".join(lines)),
    })  # fmt: skip
    assert result.is_error, text_of(result)
    assert "line 151 is not valid gb18030" in text_of(result), text_of(result)


async def test_compressed_files_are_read_as_streams(module_session: Client, tmp_path: Path) -> None:
    headers = CASES["gb18030"][0]
    text = _table("gb18030", rows=2000)
    expected = pd.read_csv(io.StringIO(text)).groupby(headers[0])[headers[1]].sum().to_dict()
    for name, data in (
        ("utf8.csv.gz", gzip.compress(text.encode("utf-8"))),
        ("gbk.csv.gz", gzip.compress(text.encode("gb18030"))),
    ):
        answer = await _analyze(module_session, {
            "filepath": name, "operations": ["sum"], "group_by": [headers[0]], "files": upload(name, data),
        })  # fmt: skip
        assert _sums_by_group(answer, headers[0], headers[1]) == pytest.approx(expected), name
        assert any("gzip-compressed" in note for note in answer["notes"]), answer["notes"]
    # zstd: written inside the sandbox (the image has the library), read by the next call in the same workspace.
    made = await module_session.call_tool("run_python", {"code": (
        "import zstandard\n"
        f"data = {text!r}.encode('utf-8')\n"
        "open('/workspace/t.csv.zst', 'wb').write(zstandard.ZstdCompressor().compress(data))"
    )})  # fmt: skip
    assert not made.is_error, text_of(made)
    answer = await _analyze(
        module_session, {"filepath": "/workspace/t.csv.zst", "operations": ["sum"], "group_by": [headers[0]]}
    )
    assert _sums_by_group(answer, headers[0], headers[1]) == pytest.approx(expected)
    assert any("zstd-compressed" in note for note in answer["notes"]), answer["notes"]


def _amounts(seed: int, rows: int = 400) -> list[float]:
    rng = random.Random(seed)
    return [rng.randint(-2_000_000, 90_000_000) / 100 for _ in range(rows)]


def _written(value: float, decimal: str, thousands: str) -> str:
    text = f"{value:,.2f}".replace(",", "\0").replace(".", decimal).replace("\0", thousands)
    return text


# (delimiter, decimal mark, thousands separator, pandas' reading of them)
STYLES = {
    "german": (";", ",", ".", {"sep": ";", "decimal": ",", "thousands": "."}),
    "decimal comma only": (";", ",", "", {"sep": ";", "decimal": ","}),
    "english with thousands": (",", ".", ",", {"sep": ",", "thousands": ","}),
    "french": (";", ",", "\u202f", {"sep": ";", "decimal": ",", "thousands": "\u202f", "engine": "python"}),
    "swiss": ("\t", ".", "'", {"sep": "\t", "thousands": "'"}),
}


@pytest.mark.parametrize("style", list(STYLES))
async def test_numbers_in_a_locales_style_answer_what_pandas_reads(
    module_session: Client, tmp_path: Path, style: str
) -> None:
    delimiter, decimal, thousands, reading = STYLES[style]
    regions = ["Nord", "Süd", "Ost", "West"]
    lines = [delimiter.join(["Region", "Betrag", "Menge"])]
    for index, value in enumerate(_amounts(seed=len(style))):
        amount = _written(value, decimal, thousands)
        if delimiter in amount:
            amount = f'"{amount}"'
        lines.append(delimiter.join([regions[index % 4], amount, str(index % 17)]))
    text = "\n".join(lines) + "\n"
    answer = await _analyze(module_session, {
        "filepath": "locale.csv", "operations": ["sum", "max"], "group_by": ["Region"],
        "files": upload("locale.csv", text),
    })  # fmt: skip
    (tmp_path / "locale.csv").write_text(text)
    frame = pd.read_csv(tmp_path / "locale.csv", **reading)
    expected = frame.groupby("Region")["Betrag"].sum().to_dict()
    assert _sums_by_group(answer, "Region", "Betrag") == pytest.approx(expected)
    numbers = answer["file"]["numbers"]
    assert numbers["decimal"] == decimal and (numbers["thousands"] or "") in (thousands, " " if thousands else "")
    if decimal != "." or thousands:
        assert any("as the decimal mark" in note for note in answer["notes"]), answer["notes"]


async def test_percentages_and_currencies_are_named_and_a_given_style_wins(module_session: Client) -> None:
    text = "item;share;price;amount\n" + "".join(f"i{n};{n}%;€ {n},50;{n},25\n" for n in range(1, 60))
    answer = await _analyze(
        module_session, {"filepath": "p.csv", "operations": ["sum"], "files": upload("p.csv", text)}
    )
    notes = " ".join(answer["notes"])
    assert "column 'share' holds numbers with a percent sign" in notes and "'1%'" in notes, notes
    assert "column 'price' holds numbers with a percent sign or a currency symbol" in notes, notes
    assert answer["results"][0]["columns"]["amount"]["sum"] == pytest.approx(sum(n + 0.25 for n in range(1, 60)))
    # The same digits read with '.' as the decimal mark, as asked: 1,25 is then not a number.
    given = await _analyze(module_session, {
        "filepath": "p.csv", "operations": ["sum"], "decimal": ".", "thousands": "", "files": upload("p.csv", text),
    })  # fmt: skip
    assert given["file"]["numbers"] == {"decimal": ".", "thousands": None, "detected": False}
    assert "amount" not in given["results"][0]["columns"]  # skipped: not numeric read that way


def _departing(delimiter: str, usual: str, other: str, rows: int, at: int) -> str:
    """A table whose amounts are written `usual` except on data row `at`, written `other` (quoted when needed)."""
    cell = f'"{other}"' if delimiter in other else other
    lines = [delimiter.join(["id", "amount"])]
    lines += [delimiter.join([str(n), cell if n == at else usual.format(n % 1000)]) for n in range(rows)]
    return "\n".join(lines) + "\n"


# (file, the line named, the value named, how the value is written, how the rest of the file writes numbers)
DEPARTURES = {
    # Past the first rows the style is detected from, and past DuckDB's own type sample.
    "a point among decimal commas": (_departing(";", "{},5", "10.5", 30000, 29990), 29992, "10.5",
                                     "'.' as the decimal mark", "',' as the decimal mark and no thousands"),
    "a decimal comma among points": (_departing(",", "{}.5", "10,5", 30000, 29990), 29992, "10,5",
                                     "',' as the decimal mark", "'.' as the decimal mark and no thousands"),
    # Within the first rows: read as thousands it would have been a wrong number, never an error.
    "English thousands among German ones": (_departing(";", "1.{:03d},5", "1,234.5", 100, 10), 12, "1,234.5",
                                            "'.' as the decimal mark and ',' between thousands",
                                            "',' as the decimal mark and '.' between thousands"),
    "German thousands among English ones": (_departing(",", '"1,{:03d}.5"', "1.234,5", 30000, 25000), 25002,
                                            "1.234,5", "',' as the decimal mark and '.' between thousands",
                                            "'.' as the decimal mark and ',' between thousands"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DEPARTURES))
async def test_a_file_that_changes_number_style_is_refused_naming_the_line(module_session: Client, case: str) -> None:
    text, line, value, written, rest = DEPARTURES[case]
    result = await module_session.call_tool(
        "analyze_csv", {"filepath": "styles.csv", "operations": ["sum"], "files": upload("styles.csv", text)}
    )
    message = text_of(result)
    assert result.is_error, message
    assert f"mixes two number styles: line {line}, column 'amount', holds {value!r}, written with {written}," in message
    assert f"its other numbers use {rest}" in message and "nothing was computed" in message, message
    assert value in text.splitlines()[line - 1]
    assert result.structured_content is not None and result.structured_content["error"]["field"] == "decimal"


async def test_a_word_late_in_a_number_column_is_not_a_change_of_style(module_session: Client) -> None:
    text = _departing(";", "{},5", "unknown", 3000, 2990)
    answer = await _analyze(
        module_session, {"filepath": "word.csv", "operations": ["sum", "count"], "files": upload("word.csv", text)}
    )
    assert answer["results"][0]["columns"]["amount"]["count"] == 3000
    assert any("'amount' skipped for sum: not numeric" in note for note in answer["notes"]), answer["notes"]


async def test_parquet_and_xlsx_twins_answer_what_the_csv_answers(module_session: Client) -> None:
    text = _table("cp1252", rows=500)
    made = await module_session.call_tool("run_python", {"code": (
        "import duckdb, openpyxl, csv\n"
        f"open('/workspace/twin.csv', 'w', encoding='utf-8').write({text!r})\n"
        "duckdb.sql(\"COPY (SELECT * FROM read_csv('/workspace/twin.csv')) TO '/workspace/twin.parquet' (FORMAT parquet)\")\n"
        "book = openpyxl.Workbook()\n"
        "book.active.title = 'notes'\n"
        "book.active.append(['nothing here'])\n"
        "data = book.create_sheet('data')\n"
        "for number, row in enumerate(csv.reader(open('/workspace/twin.csv', encoding='utf-8'))):\n"
        "    data.append(row if number == 0 else [row[0], float(row[1]), row[2]])\n"
        "book.save('/workspace/twin.xlsx')"
    )})  # fmt: skip
    assert not made.is_error, text_of(made)
    headers = CASES["cp1252"][0]
    asked = {"operations": ["sum", "average", "min", "max", "count"], "group_by": [headers[0]]}
    twin = await _analyze(module_session, {"filepath": "/workspace/twin.csv", **asked})
    parquet = await _analyze(module_session, {"filepath": "/workspace/twin.parquet", **asked})
    workbook = await _analyze(module_session, {"filepath": "/workspace/twin.xlsx", "sheet": "data", **asked})
    assert twin["file"]["format"] == "csv" and parquet["file"]["format"] == "parquet"
    assert workbook["file"]["format"] == "xlsx" and "sheet 'data'" in workbook["file"]["encoding"]
    for other in (parquet, workbook):
        assert other["results"] == twin["results"], other["file"]
    missing = await module_session.call_tool(
        "analyze_csv", {"filepath": "/workspace/twin.xlsx", "sheet": "sales", **asked}
    )
    assert missing.is_error and "sheet 'sales' is not in" in text_of(missing) and "'data'" in text_of(missing)


async def test_a_workbook_whose_text_numbers_change_style_is_refused_naming_the_row(module_session: Client) -> None:
    made = await module_session.call_tool("run_python", {"code": (
        "import openpyxl\n"
        "book = openpyxl.Workbook()\n"
        "book.active.append(['id', 'amount'])\n"
        "for n in range(60):\n"
        "    book.active.append([n, '10.5' if n == 40 else f'{n},25'])\n"
        "book.save('/workspace/typed-as-text.xlsx')"
    )})  # fmt: skip
    assert not made.is_error, text_of(made)
    result = await module_session.call_tool(
        "analyze_csv", {"filepath": "/workspace/typed-as-text.xlsx", "operations": ["sum"]}
    )
    assert result.is_error and "row 42, column 'amount', holds '10.5'" in text_of(result), text_of(result)


DATE_STYLES = {"%Y/%m/%d": "slashes", "%b %d %Y": "month names", "%d.%m.%Y": "dots", "%Y-%m-%dT%H:%M:%S%z": "iso zoned"}


@pytest.mark.parametrize("fmt", list(DATE_STYLES))
async def test_dates_as_written_give_min_max_and_groups_by_month(module_session: Client, fmt: str) -> None:
    import datetime

    rng = random.Random(5)
    start = datetime.datetime(2019, 11, 3, 8, 30, tzinfo=datetime.UTC)
    days = [start + datetime.timedelta(days=rng.randint(0, 200), hours=rng.randint(0, 12)) for _ in range(300)]
    amounts = [rng.randint(1, 1000) / 4 for _ in days]
    text = "when,amount\n" + "".join(f"{d.strftime(fmt)},{a}\n" for d, a in zip(days, amounts, strict=True))
    answer = await _analyze(module_session, {
        "filepath": "d.csv", "operations": ["min", "max"], "columns": ["when"], "files": upload("d.csv", text),
    })  # fmt: skip
    stats = answer["results"][0]["columns"]["when"]
    written = [datetime.datetime.strptime(d.strftime(fmt), fmt) for d in days]  # what the text says
    assert stats["min"][:10] == min(written).date().isoformat() and stats["max"][:10] == max(written).date().isoformat()
    grouped = await _analyze(module_session, {
        "filepath": "d.csv", "operations": ["sum"], "columns": ["amount"], "group_by": ["when"], "period": "month",
        "files": upload("d.csv", text),
    })  # fmt: skip
    frame = pd.DataFrame({"month": [w.strftime("%Y-%m-01") for w in written], "amount": amounts})
    expected = frame.groupby("month")["amount"].sum().to_dict()
    assert {k[:10]: v for k, v in _sums_by_group(grouped, "when", "amount").items()} == pytest.approx(expected)
    assert any("grouped by month" in note for note in grouped["notes"]), grouped["notes"]
    refused = await module_session.call_tool("analyze_csv", {
        "filepath": "d.csv", "operations": ["sum"], "group_by": ["amount"], "period": "year",
        "files": upload("d.csv", text),
    })  # fmt: skip
    assert refused.is_error and "group_by has none" in text_of(refused), text_of(refused)


FRENCH_BAD = {150: "extra", 420: "missing", 777: "extra", 1200: "missing", 1650: "extra", 1999: "missing"}
"""Rows of the French export with a field too many or too few (by index among its 2,000 rows)."""


def _french_export(codec: str, newline: str) -> str:
    """A French ERP's export: `;`-separated, decimal commas, dates day first, 2,000 rows of which 6 have a wrong
    number of fields."""
    regions = ["Île-de-France", "Auvergne-Rhône-Alpes", "Provence-Alpes-Côte d'Azur", "Bretagne", "Occitanie"]
    modes = ["carte", "espèces", "chèque", "virement"]
    lines = ["id_commande;date_commande;région;âge_client;montant_ttc;remise;mode_paiement"]
    for i in range(2000):
        fields = [str(i + 1), f"{1 + i % 28:02d}/{1 + i % 12:02d}/2026", regions[i % 5], str(18 + i % 60),
                  f"{(i * 37) % 5000 + 0.5:.2f}".replace(".", ","), f"{i % 20},5", modes[i % 4]]  # fmt: skip
        if FRENCH_BAD.get(i) == "extra":
            fields.append("note libre")
        elif FRENCH_BAD.get(i) == "missing":
            fields.pop()
        lines.append(";".join(fields))
    return newline.join(lines) + newline


@pytest.mark.parametrize(("codec", "newline"), [("utf-8", "\n"), ("latin-1", "\r\n")])
async def test_a_french_export_with_bad_rows_is_read_by_the_delimiter_most_rows_agree_on(
    module_session: Client, tmp_path: Path, codec: str, newline: str
) -> None:
    data = _french_export(codec, newline).encode(codec)
    arguments = {"filepath": "export.csv", "operations": ["sum", "count"], "columns": ["montant_ttc"],
                 "group_by": ["région"], "files": upload("export.csv", data)}  # fmt: skip
    result = await module_session.call_tool("analyze_csv", arguments)
    assert not result.is_error and result.structured_content is not None, text_of(result)
    answer = dict(result.structured_content)
    (tmp_path / "export.csv").write_bytes(data)
    frame = pd.read_csv(tmp_path / "export.csv", sep=";", decimal=",", encoding=codec, on_bad_lines="skip")
    frame = frame[frame["mode_paiement"].notna()]  # pandas pads a row a field short: it is bad all the same
    names = ["id_commande", "date_commande", "région", "âge_client", "montant_ttc", "remise", "mode_paiement"]
    assert [column["name"] for column in answer["file"]["columns"]] == names
    assert answer["file"]["delimiter"] == ";" and answer["file"]["rows"] == 1994 == len(frame)
    assert answer["file"]["bad_rows"] == {
        "count": 6, "lines": [i + 2 for i in sorted(FRENCH_BAD)], "kinds": {"missing columns": 3, "too many columns": 3}
    }  # fmt: skip
    assert _sums_by_group(answer, "région", "montant_ttc") == pytest.approx(
        frame.groupby("région")["montant_ttc"].sum().to_dict()
    )
    text = text_of(result)
    assert "1,994 rows, 7 columns" in text and "delimiter ';'" in text and "6 bad rows skipped" in text, text
    assert "6 bad row(s) skipped" in text and "line 152, 422, 779, 1202, 1652, 2001" in text, text
    if codec == "latin-1":
        assert answer["file"]["encoding"].startswith("cp1252 (detected"), answer["file"]["encoding"]
    refused = await module_session.call_tool("analyze_csv", {**arguments, "skip_bad_rows": False})
    assert refused.is_error and "6 row(s) do not have the file's 7 fields (line 152, 422" in text_of(refused)
    said = dict(refused.structured_content or {})
    assert said["error"]["field"] == "skip_bad_rows", said
    given = await module_session.call_tool(
        "analyze_csv",
        {
            "filepath": "export.csv",
            "operations": ["count"],
            "delimiter": ",",
            "header": False,
        },
    )  # fmt: skip  (a `;` file read at its decimal commas: most rows misread, so refused, never a success)
    assert given.is_error and "most of the file would be dropped" in text_of(given), text_of(given)
    assert (given.structured_content or {})["error"]["field"] == "delimiter", given.structured_content


LAENDER = ["Baden-Württemberg", "Bayern", "Berlin", "Sachsen", "Schleswig-Holstein", "Thüringen"]
KUNDEN = ["Müller GmbH", "Schäfer AG", "Köhler & Söhne", "Weiß KG", "Bäckerei Fuß"]


def _german_export(rows: int = 240) -> tuple[bytes, int, pd.DataFrame]:
    """A German sales export as Excel saves it as CSV: Latin-1, `;`, `1.234,56`, `31.12.2025`, CRLF, a title and a
    blank line above the header, a few rows with a field too many, and a totals row (`Summe;;;…`) summing every
    row. Its bytes, the totals row's line, and its rows (bad ones too, without the totals row)."""
    rng = random.Random(11)
    lines = ["Umsatzbericht 2025 (Export)", "", "Datum;Bundesland;Kunde;Umsatz"]
    records: list[dict[str, Any]] = []
    for index in range(rows):
        day, month, amount = rng.randint(1, 28), rng.randint(1, 12), round(rng.uniform(100, 20_000), 2)
        land = rng.choice(LAENDER)
        written = f"{amount:,.2f}".replace(",", " ").replace(".", ",").replace(" ", ".")
        extra = ";siehe Notiz" if index % 60 == 7 else ""  # a field too many: still a sale, summed by the total
        lines.append(f"{day:02d}.{month:02d}.2025;{land};{rng.choice(KUNDEN)};{written}{extra}")
        records.append({"month": month, "Bundesland": land, "Umsatz": amount, "bad": bool(extra)})
    total = f"{sum(float(r['Umsatz']) for r in records):,.2f}".replace(",", " ").replace(".", ",").replace(" ", ".")
    lines.append(f"Summe;;;{total}")
    return ("\r\n".join(lines) + "\r\n").encode("latin-1"), len(lines), pd.DataFrame(records)


async def test_a_german_excel_export_with_a_title_bad_rows_and_a_totals_row_reads_as_its_author_means(
    module_session: Client,
) -> None:
    data, totals_line, frame = _german_export()
    good = frame[~frame["bad"]]
    arguments = {"filepath": "umsatz.csv", "operations": ["sum", "count"], "group_by": ["Bundesland"],
                 "files": upload("umsatz.csv", data)}  # fmt: skip
    kept = await _analyze(module_session, arguments)
    encoding = kept["file"]["encoding"]
    assert encoding.startswith("cp1252 (detected") and "reads it alike" in encoding, encoding  # its runner-up named
    assert kept["file"]["delimiter"] == ";" and kept["file"]["header"] is True
    assert [column["name"] for column in kept["file"]["columns"]] == ["Datum", "Bundesland", "Kunde", "Umsatz"]
    notes = kept["notes"]
    assert any(
        n.startswith("the header is on line 3; the 2 line(s) above it were skipped: 'Umsatzbericht") for n in notes
    )
    said = f"line {totals_line} ('Summe') looks like a totals row: its 'Umsatz' is the sum of the rows above"
    assert any(n.startswith(said) and "drop_totals: true leaves it out" in n for n in notes), notes
    assert f"column 'Datum' holds dates written '%d.%m.%Y' except line {totals_line} ('Summe')" in notes, notes
    sums = {entry["group"]["Bundesland"]: entry["columns"]["Umsatz"]["sum"] for entry in kept["results"]}
    assert sums.pop(None) == pytest.approx(frame["Umsatz"].sum())  # the total, a group of its own, unless dropped
    assert sums == pytest.approx(good.groupby("Bundesland")["Umsatz"].sum().to_dict())
    assert "Thüringen" in sums

    dropped = await _analyze(module_session, {**arguments, "drop_totals": True})
    by_land = {entry["group"]["Bundesland"]: entry["columns"]["Umsatz"]["sum"] for entry in dropped["results"]}
    assert None not in by_land and by_land == pytest.approx(sums)
    assert any(n.endswith("it is left out (drop_totals)") for n in dropped["notes"]), dropped["notes"]
    monthly = await _analyze(module_session, {**arguments, "group_by": ["Datum"], "period": "month",
                                              "drop_totals": True})  # fmt: skip
    by_month = [entry["columns"]["Umsatz"]["sum"] for entry in monthly["results"]]
    assert by_month == pytest.approx(list(good.groupby("month")["Umsatz"].sum()))

    wrong = await module_session.call_tool("analyze_csv", {**arguments, "group_by": [], "header_row": 1})
    assert wrong.is_error, text_of(wrong)  # most rows would be dropped: refused, never a success of a few rows
    error = (wrong.structured_content or {})["error"]
    assert error["field"] == "header_row" and "most of the file would be dropped" in error["message"], error

"""License detection (SPDX tags, header prose, real libstdc++ and Boost headers) and the
allow/deny policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from megacpp.data.document import Document
from megacpp.data.license import (
    UNKNOWN,
    LicenseExpressionError,
    LicenseStep,
    detect_license,
    license_verdict,
    parse_spdx,
)
from megacpp.data.pipeline import StageStats

BOOST = Path("/usr/include/boost")
LIBSTDCXX = Path("/usr/include/c++/12")
CODE = "\nint f() { return 1; }\n"


def commented(text: str, style: str = "//") -> str:
    if style == "/*":
        return "/*\n" + "\n".join(f" * {line}" for line in text.splitlines()) + "\n */" + CODE
    return "\n".join(f"// {line}" for line in text.splitlines()) + CODE


# ------------------------------------------------------------------ SPDX expressions


@pytest.mark.parametrize(
    ("expr", "canonical"),
    [
        ("MIT", "MIT"),
        ("mit", "MIT"),
        ("Apache-2.0 OR MIT", "Apache-2.0 OR MIT"),
        ("GPL-2.0-or-later WITH Linux-syscall-note", "GPL-2.0-or-later WITH Linux-syscall-note"),
        ("GPL-2.0+", "GPL-2.0-or-later"),
        ("GPL-2.0 with linux-syscall-note", "GPL-2.0-only WITH Linux-syscall-note"),
        ("LGPL-2.1+ AND (MIT OR BSD-3-Clause)", "LGPL-2.1-or-later AND (MIT OR BSD-3-Clause)"),
        ("MIT OR Apache-2.0 AND BSD-2-Clause", "MIT OR (Apache-2.0 AND BSD-2-Clause)"),  # explicit
        ("(MIT OR Apache-2.0) AND BSD-2-Clause", "(MIT OR Apache-2.0) AND BSD-2-Clause"),
        ("LicenseRef-Acme-1", "LicenseRef-Acme-1"),
    ],
)
def test_parse_spdx_canonical(expr, canonical):
    assert str(parse_spdx(expr)) == canonical


def test_and_binds_tighter_than_or():
    expr = parse_spdx("MIT OR Apache-2.0 AND BSD-2-Clause")
    assert expr.op == "OR" and expr.parts[1].op == "AND"


@pytest.mark.parametrize(
    "bad", ["", "MIT OR", "(MIT", "MIT)", "AND MIT", "MIT WITH", "MIT / GPL", "MIT MIT"]
)
def test_malformed_expressions_raise(bad):
    with pytest.raises(LicenseExpressionError):
        parse_spdx(bad)


# ------------------------------------------------------------------ detection


def test_spdx_tags():
    assert detect_license("// SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note\n") == (
        "GPL-2.0-only WITH Linux-syscall-note"
    )
    assert (
        detect_license("/* SPDX-License-Identifier: Apache-2.0 OR MIT */\nint x;")
        == "Apache-2.0 OR MIT"
    )
    assert (
        detect_license("# SPDX-License-Identifier: MIT\n// SPDX-License-Identifier: Zlib\n")
        == "MIT AND Zlib"
    )


def test_malformed_tag_falls_back_to_prose():
    text = "// SPDX-License-Identifier: MIT OR\n" + commented(
        "Distributed under the Boost Software License, Version 1.0."
    )
    assert detect_license(text) == "BSL-1.0"


def test_tag_plus_other_prose_keeps_both_but_not_twice():
    mit = "Permission is hereby granted, free of charge, to any person obtaining a copy"
    assert detect_license("// SPDX-License-Identifier: MIT\n" + commented(mit)) == "MIT"
    gpl = "under the terms of the GNU General Public License, version 2."
    assert detect_license(commented(gpl) + "// SPDX-License-Identifier: Apache-2.0\n") == (
        "Apache-2.0 AND GPL-2.0-only"
    )


HEADERS = {
    "GPL-2.0-only": "This program is free software; you can redistribute it and/or modify it "
    "under the terms of the GNU General Public License version 2 as published by the Free "
    "Software Foundation.",
    "GPL-2.0-or-later": "This program is free software; you can redistribute it and/or modify "
    "it under the terms of the GNU General Public License as published by the Free Software "
    "Foundation; either version 2 of the License, or (at your option) any later version.",
    "GPL-3.0-or-later": "under the terms of the GNU General Public License as published by "
    "the Free Software Foundation, either version 3 of the License, or\n(at your option) any "
    "later version.",
    "LGPL-2.1-or-later": "This library is free software; you can redistribute it and/or "
    "modify it under the terms of the GNU Lesser General Public License as published by the "
    "Free Software Foundation; either version 2.1 of the License, or (at your option) any "
    "later version.",
    "LGPL-3.0-only": "under the terms of the GNU Lesser General Public License version 3.",
    "LGPL-2.0-or-later": "under the terms of the GNU Library General Public License as "
    "published by the Free Software Foundation; either version 2 of the License, or (at your "
    "option) any later version.",
    "AGPL-3.0-or-later": "under the terms of the GNU Affero General Public License as "
    "published by the Free Software Foundation, either version 3 of the License, or (at your "
    "option) any later version.",
    "GPL-3.0-or-later WITH GCC-exception-3.1": "under the terms of the GNU General Public "
    "License as published by the Free Software Foundation; either version 3, or (at your "
    "option) any later version.\n\nUnder Section 7 of GPL version 3, you are granted "
    "additional permissions described in the GCC Runtime Library Exception, version 3.1.",
    "Apache-2.0": 'Licensed under the Apache License, Version 2.0 (the "License");\nyou may '
    "not use this file except in compliance with the License.",
    "Apache-2.0 WITH LLVM-exception": "Part of the LLVM Project, under the Apache License v2.0 "
    "with LLVM Exceptions.",
    "MIT": "Permission is hereby granted, free of charge, to any person obtaining a copy\nof "
    'this software and associated documentation files (the "Software"), to deal',
    "BSD-2-Clause": "Redistribution and use in source and binary forms, with or without\n"
    "modification, are permitted provided that the following conditions are met:\n1. "
    "Redistributions of source code must retain the above copyright notice.",
    "BSD-3-Clause": "Redistribution and use in source and binary forms, with or without "
    "modification, are permitted provided that ... Neither the name of the copyright holder "
    "nor the names of its contributors may be used to endorse or promote products derived",
    "BSD-4-Clause": "Redistribution and use in source and binary forms, with or without "
    "modification, are permitted provided that ... All advertising materials mentioning "
    "features or use of this software must display the following acknowledgement",
    "BSL-1.0": "Distributed under the Boost Software License, Version 1.0. (See accompanying\n"
    "file LICENSE_1_0.txt or copy at http://www.boost.org/LICENSE_1_0.txt)",
    "MPL-2.0": "This Source Code Form is subject to the terms of the Mozilla Public\nLicense, "
    "v. 2.0. If a copy of the MPL was not distributed with this file,",
    "ISC": "Permission to use, copy, modify, and/or distribute this software for any\npurpose "
    "with or without fee is hereby granted, provided that the above",
    "Zlib": "This software is provided 'as-is', without any express or implied warranty. "
    "Permission is granted to anyone to use this software for any purpose,\nincluding "
    "commercial applications, and to alter it and redistribute it\nfreely, subject to",
    "Unlicense": "This is free and unencumbered software released into the public domain.",
    "CC0-1.0": "To the extent possible under law, the author has waived all copyright. "
    "See http://creativecommons.org/publicdomain/zero/1.0/",
    "HPND-sell-variant": "Permission to use, copy, modify, distribute and sell this software\n"
    "and its documentation for any purpose is hereby granted without fee,",
    "LicenseRef-Public-Domain": "This file is placed in the public domain by its author.",
    "LicenseRef-Proprietary": "Copyright (c) Acme Corp. All rights reserved.\nProprietary and "
    "confidential. Unauthorized copying of this file is strictly prohibited.",
}


@pytest.mark.parametrize("spdx", list(HEADERS))
@pytest.mark.parametrize("style", ["//", "/*"])
def test_header_prose(spdx, style):
    assert detect_license(commented(HEADERS[spdx], style)) == spdx


def test_several_notices_and_dual_licensing():
    both = commented(HEADERS["BSL-1.0"] + "\n\n" + HEADERS["MIT"])
    assert detect_license(both) == "BSL-1.0 AND MIT"
    dual = commented("This code may be used under either of the following two licences:\n"
                     + HEADERS["MIT"] + "\nOr:\n" + HEADERS["BSL-1.0"])  # fmt: skip
    assert detect_license(dual) == "MIT OR BSL-1.0"


def test_unknown_and_proprietary_only_without_a_license():
    assert detect_license("int main() { return 0; }\n") == UNKNOWN
    assert detect_license(commented("Copyright (c) 2020 Someone. All rights reserved.")) == UNKNOWN
    # "All rights reserved" next to a BSD text is the BSD license, not a proprietary notice
    assert (
        detect_license(commented("All rights reserved.\n" + HEADERS["BSD-2-Clause"]))
        == "BSD-2-Clause"
    )


def test_only_the_head_is_scanned():
    assert detect_license("int x;\n" * 3000 + commented(HEADERS["MIT"])) == UNKNOWN


def test_real_libstdcxx_headers():
    if not LIBSTDCXX.is_dir():
        pytest.skip("libstdc++ 12 headers not installed")
    gpl = "GPL-3.0-or-later WITH GCC-exception-3.1"
    expected = {
        "vector": f"{gpl} AND HPND-sell-variant",  # HP's and SGI's notices follow the GPL one
        "optional": gpl,
        "bits/stl_algo.h": f"{gpl} AND HPND-sell-variant",
        "barrier": "Apache-2.0 WITH LLVM-exception AND GPL-3.0-or-later",  # no runtime exception
        "stacktrace": "GPL-3.0-only WITH GCC-exception-3.1",  # "either version 3." and no later
    }
    for name, spdx in expected.items():
        assert detect_license((LIBSTDCXX / name).read_text()) == spdx, name


def test_every_libstdcxx_header_is_allowed_by_default():
    if not LIBSTDCXX.is_dir():
        pytest.skip("libstdc++ 12 headers not installed")
    from megacpp.data.config import CorpusConfig

    cfg = CorpusConfig()
    for path in sorted(p for p in LIBSTDCXX.rglob("*") if p.is_file()):
        spdx = detect_license(path.read_text(errors="replace"))
        assert (
            spdx != UNKNOWN and license_verdict(spdx, cfg.license_allow, cfg.license_deny) is None
        ), path


def test_real_boost_headers():
    if not BOOST.is_dir():
        pytest.skip("Boost headers not installed (apt-get install libboost-dev)")
    for name in ("version.hpp", "shared_ptr.hpp", "optional/optional.hpp", "any.hpp"):
        path = BOOST / name
        if path.is_file() and name != "any.hpp":
            assert detect_license(path.read_text()) == "BSL-1.0", name
    # Boost.Any's header carries no license text at all
    if (BOOST / "any.hpp").is_file():
        assert detect_license((BOOST / "any.hpp").read_text()) == UNKNOWN


# ------------------------------------------------------------------ policy


@pytest.mark.parametrize(
    ("expr", "allow", "deny", "verdict"),
    [
        ("MIT", [], [], None),
        ("MIT", ["MIT"], [], None),
        ("MIT", ["Apache-2.0"], [], "license_not_allowed"),
        ("MIT", [], ["mit"], "license_denied"),
        ("MIT", ["MIT"], ["MIT"], "license_denied"),  # deny wins
        ("GPL-3.0-only OR MIT", ["MIT"], [], None),  # one acceptable alternative suffices
        ("GPL-3.0-only OR MIT", [], ["GPL-*"], None),
        ("GPL-3.0-only AND MIT", [], ["GPL-*"], "license_denied"),  # every part applies
        ("GPL-3.0-only AND MIT", ["MIT"], [], "license_not_allowed"),
        ("GPL-3.0-or-later WITH GCC-exception-3.1", ["GPL-3.0-or-later"], [], None),
        (
            "GPL-3.0-or-later WITH GCC-exception-3.1",
            ["GPL-3.0-or-later WITH GCC-exception-3.1"],
            [],
            None,
        ),
        (
            "GPL-3.0-or-later",
            ["GPL-3.0-or-later WITH GCC-exception-3.1"],
            [],
            "license_not_allowed",
        ),
        ("GPL-3.0-or-later WITH GCC-exception-3.1", [], ["GPL-3.0-or-later"], "license_denied"),
        ("(MIT OR GPL-2.0-only) AND BSL-1.0", ["MIT", "BSL-1.0"], [], None),
        ("(MIT OR GPL-2.0-only) AND BSL-1.0", ["GPL-*"], [], "license_not_allowed"),
    ],
)
def test_license_verdict(expr, allow, deny, verdict):
    assert license_verdict(expr, allow, deny) == verdict


def run_step(step: LicenseStep, text: str):
    doc = Document("/src", "f.cpp", len(text), "0" * 64, text=text)
    stats = StageStats("license")
    return step.process(doc, stats), doc, stats


def test_license_step_records_and_counts():
    out, doc, stats = run_step(LicenseStep(), commented(HEADERS["MIT"]))
    assert out is doc and doc.license == "MIT" and stats.notes == {"license=MIT": 1}


def test_license_step_drop_reasons():
    proprietary = commented(HEADERS["LicenseRef-Proprietary"])
    assert (
        run_step(LicenseStep(deny=["LicenseRef-Proprietary"]), proprietary)[0] == "license_denied"
    )
    assert (
        run_step(LicenseStep(allow=["MIT"]), commented(HEADERS["BSL-1.0"]))[0]
        == "license_not_allowed"
    )
    out, doc, _ = run_step(LicenseStep(keep_unknown=False), CODE)
    assert out == "unknown_license" and doc.license == UNKNOWN
    out, doc, _ = run_step(LicenseStep(keep_unknown=True), CODE)
    assert out is doc


def test_license_step_decides_each_expression_once(monkeypatch):
    """The step remembers the verdict per expression (a corpus has a handful); repeated and
    interleaved documents get the same decisions as a fresh verdict each time."""
    from megacpp.data import license as license_module

    calls: list[str] = []

    def counting_verdict(expression, allow, deny):
        calls.append(expression)
        return license_verdict(expression, allow, deny)

    monkeypatch.setattr(license_module, "license_verdict", counting_verdict)
    step = LicenseStep(allow=["MIT", "BSL-1.0"], deny=["GPL-*"])
    texts = [commented(HEADERS[k]) for k in ("MIT", "BSL-1.0", "MIT", "BSL-1.0", "MIT")]
    decisions = [run_step(step, text)[0] for text in texts]
    assert [d if isinstance(d, str) else d.license for d in decisions] == [
        "MIT", "BSL-1.0", "MIT", "BSL-1.0", "MIT"
    ]  # fmt: skip
    assert sorted(calls) == ["BSL-1.0", "MIT"]
    denied = commented(HEADERS["LicenseRef-Proprietary"])
    step = LicenseStep(deny=["LicenseRef-*"])
    assert [run_step(step, denied)[0] for _ in range(3)] == ["license_denied"] * 3

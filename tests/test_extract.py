"""Text extraction for vector stores (unmask.retrieval.extract): PDF through its text layer, page by page; a
damaged, scanned (no text) or unsupported file is an ExtractError naming the file."""
import io

import pytest

from unmask.retrieval.extract import ExtractError, extract_text

PAGES = ["The quux frobnicator turns widgets.", "Page two explains the sprocket calibration."]


def make_pdf(pages: list[str]) -> bytes:
    """A real PDF written by matplotlib (a test dependency), one page per text, TrueType fonts (pdf.fonttype
    42) so that the text layer holds the characters."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_pdf import PdfPages

    buf = io.BytesIO()
    with matplotlib.rc_context({"pdf.fonttype": 42}), PdfPages(buf) as pdf:
        for text in pages:
            fig = plt.figure(figsize=(6, 2))
            if text:
                fig.text(0.05, 0.5, text)
            else:
                fig.add_subplot().plot([0, 1], [1, 0])  # drawing only: no characters on the page
                fig.axes[0].axis("off")
            pdf.savefig(fig)
            plt.close(fig)
    return buf.getvalue()


def test_pdf_text_layer_page_by_page():
    text = extract_text("manual.PDF", make_pdf(PAGES))
    assert text.split("\n\n") == PAGES


def test_pdf_without_text_damaged_or_truncated_is_refused_naming_the_file():
    with pytest.raises(ExtractError, match="'scan.pdf' has no text layer"):
        extract_text("scan.pdf", make_pdf([""]))
    with pytest.raises(ExtractError, match="'broken.pdf' is not a readable PDF"):
        extract_text("broken.pdf", b"%PDF-1.4\nthis is not a PDF body")
    good = make_pdf(PAGES)
    with pytest.raises(ExtractError, match="'half.pdf'"):
        extract_text("half.pdf", good[: len(good) // 3])


def test_other_types_as_before():
    assert extract_text("a.md", "# héllo".encode("utf-8-sig")) == "# héllo"
    with pytest.raises(ExtractError, match="type '.docx' is not supported"):
        extract_text("a.docx", b"PK")

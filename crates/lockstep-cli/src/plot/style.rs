//! What every figure of `lockstep` shares: the bundled font and the line colours.

use anyhow::Result;
use plotters::style::{FontStyle, RGBColor};

/// The bundled DejaVu Sans font (assets/, Bitstream Vera/DejaVu license), so no system font
/// is needed.
pub static FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

/// Line colours that read on white (the Tableau 10 palette without its yellow-green and
/// cyan): blue, orange, green, red, purple, brown, pink, grey.
pub const COLOURS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// The font family every figure's text uses, under which [`register_font`] registers the
/// bundled font. It is a CSS font list because SVG figures name it in their `<text>`
/// elements: a viewer with DejaVu Sans shows the text with the font plotters measured it
/// with (the PNG's), any other its own sans-serif.
pub const FAMILY: &str = "DejaVu Sans, sans-serif";

/// The text style of every figure: the bundled font ([`FAMILY`]) at `px` pixels, rounded up
/// to an even size.
///
/// Why even: plotters 0.3.7 (`style/font/ab_glyph.rs`) places each glyph at
/// `(size / 2 + top of its pixel bounds) as i32`, and at an odd size the half-pixel is rounded
/// toward zero, down for glyphs that reach above `size / 2` and up for the others. Small
/// glyphs on the baseline (the decimal point, the comma) then sit one pixel above the digits:
/// "22.0" read as "22·0" in the corner plots' 11-pixel tick labels. At even sizes every glyph
/// shares one baseline.
pub fn font(px: u32) -> (&'static str, u32) {
    (FAMILY, px + px % 2)
}

/// Registers the bundled font as [`FAMILY`], the family every figure's text uses, and as
/// plotters' default `sans-serif`.
///
/// Errors: the font cannot be loaded.
pub fn register_font() -> Result<()> {
    for family in [FAMILY, "sans-serif"] {
        plotters::style::register_font(family, FontStyle::Normal, FONT)
            .map_err(|_| anyhow::anyhow!("the bundled font cannot be loaded"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use plotters::prelude::*;

    /// The lowest inked row of `text` drawn at (4, 4) in the `px`-pixel bundled font.
    fn bottom_row(text: &str, px: f64) -> usize {
        register_font().unwrap();
        let (w, h) = (80usize, 60usize);
        let mut buf = vec![255u8; w * h * 3];
        {
            let root =
                BitMapBackend::with_buffer(&mut buf, (w as u32, h as u32)).into_drawing_area();
            root.draw_text(text, &(FAMILY, px).into_font().color(&BLACK), (4, 4))
                .unwrap();
            root.present().unwrap();
        }
        (0..h)
            .rev()
            .find(|&y| (0..w).any(|x| buf[(y * w + x) * 3] < 160))
            .unwrap_or(0)
    }

    /// The digit 1 and the decimal point share one baseline at every size the figures may ask
    /// for (at odd sizes the point sat a pixel high before [`font`] rounded them).
    #[test]
    fn the_decimal_point_sits_on_the_baseline_at_every_size() {
        for px in 10..=40 {
            let size = font(px).1 as f64;
            // Both sit flat on the baseline ("0" overshoots it at large sizes, as it should).
            let (one, point) = (bottom_row("1", size), bottom_row(".", size));
            assert_eq!(one, point, "{px} px (drawn at {size})");
        }
    }
}

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

/// Registers the bundled font as `sans-serif`, the family every figure's text uses.
///
/// Errors: the font cannot be loaded.
pub fn register_font() -> Result<()> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| anyhow::anyhow!("the bundled font cannot be loaded"))
}

//! How every figure of `lockstep` reaches its file: as PNG (plotters' bitmap backend) or as
//! SVG (plotters' SVG backend: vector output, text kept as text), from one drawing code that
//! is generic over the backend ([`Figure`]), written atomically ([`write_figure`]).

use super::style::register_font;
use anyhow::{bail, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};

/// The file format of a figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PlotFormat {
    /// A PNG image (raster).
    Png,
    /// An SVG drawing (vector: lines, shapes and text stay sharp at any size; what papers
    /// take).
    Svg,
}

impl PlotFormat {
    /// The file name extension of the format (`png`, `svg`).
    pub fn extension(self) -> &'static str {
        match self {
            PlotFormat::Png => "png",
            PlotFormat::Svg => "svg",
        }
    }

    /// The format a file name asks for by its extension (`.png`, `.svg`, any case).
    ///
    /// Errors: another or no extension, naming `flag` (the option that gave the path, as the
    /// user wrote it) and the path.
    pub fn of_path(path: &Path, flag: &str) -> Result<Self> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .unwrap_or("")
            .to_ascii_lowercase();
        match ext.as_str() {
            "png" => Ok(PlotFormat::Png),
            "svg" => Ok(PlotFormat::Svg),
            _ => bail!(
                "{flag} {}: the file name's extension picks the plot format: use .png or .svg{}",
                path.display(),
                if ext == "pdf" {
                    " (for a PDF, write .svg and convert it, e.g. with `rsvg-convert -f pdf` or Inkscape)"
                } else {
                    ""
                }
            ),
        }
    }
}

/// A figure: its size and its drawing, the same on every plotters backend, so its PNG and
/// its SVG have one layout and the same labels.
pub trait Figure {
    /// The figure's size in pixels (in the SVG, user units of the same size).
    fn size(&self) -> (u32, u32);

    /// Draws the figure on `root`, a blank area of [`Figure::size`].
    ///
    /// Errors: plotters' drawing errors.
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static;
}

/// Writes `figure` into `out` in the format its extension names ([`PlotFormat::of_path`]):
/// drawn into a hidden file next to it, then renamed over it, so `out` is either the old
/// file or the whole new figure.
///
/// Errors: an extension other than .png or .svg (before anything is written), the bundled
/// font cannot be loaded, drawing fails, `out`'s folder cannot be written.
pub fn write_figure(figure: &impl Figure, out: &Path) -> Result<()> {
    let format = PlotFormat::of_path(out, "the figure")?;
    register_font()?;
    let dir = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let name = out
        .file_name()
        .with_context(|| format!("{} is not a file name", out.display()))?;
    // The extension stays last: the PNG encoder picks the format from it.
    let tmp = dir.join(format!(
        ".tmp{}-{}",
        std::process::id(),
        name.to_string_lossy()
    ));
    let size = figure.size();
    let drawn = match format {
        PlotFormat::Png => {
            let root = BitMapBackend::new(&tmp, size).into_drawing_area();
            figure.draw(&root).and_then(|()| Ok(root.present()?))
        }
        PlotFormat::Svg => {
            let root = SVGBackend::new(&tmp, size).into_drawing_area();
            figure.draw(&root).and_then(|()| Ok(root.present()?))
        }
    };
    let result = drawn
        .with_context(|| format!("cannot write {}", out.display()))
        .and_then(|()| {
            std::fs::rename(&tmp, out)
                .with_context(|| format!("cannot rename {} to {}", tmp.display(), out.display()))
        });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The text of every `<text>` element of the SVG file `path` (trimmed), in order, after Python's
    /// XML parser (`xml.etree`) read the whole file: a file that is not well-formed XML, or
    /// whose root is not `<svg>`, fails the test.
    pub(crate) fn svg_texts(path: &Path) -> Vec<String> {
        let script = r#"
import sys, json, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
assert root.tag == "{http://www.w3.org/2000/svg}svg", root.tag
print(json.dumps([(t.text or "").strip() for t in root.iter("{http://www.w3.org/2000/svg}text")]))
"#;
        let out = lockstep_testkit::python(script, &[path.as_os_str()]);
        serde_json::from_str(out.trim()).unwrap()
    }

    /// A figure of one labelled chart.
    struct Small;

    impl Figure for Small {
        fn size(&self) -> (u32, u32) {
            (200, 150)
        }

        fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()>
        where
            DB::ErrorType: 'static,
        {
            root.fill(&WHITE)?;
            let mut chart = ChartBuilder::on(root)
                .x_label_area_size(30)
                .build_cartesian_2d(0.0..1.0, 0.0..1.0)?;
            chart.configure_mesh().x_desc("x <&> y").draw()?;
            Ok(())
        }
    }

    /// The extension picks the format; anything else is refused naming the flag and the
    /// path, before a file is written.
    #[test]
    fn the_extension_picks_the_format_and_others_are_refused_without_writing() {
        let dir = tempfile::tempdir().unwrap();
        let flag = "--corner";
        for (name, want) in [
            ("a.png", PlotFormat::Png),
            ("a.PNG", PlotFormat::Png),
            ("a.svg", PlotFormat::Svg),
        ] {
            assert_eq!(PlotFormat::of_path(Path::new(name), flag).unwrap(), want);
        }
        for name in ["a.pdf", "a.jpg", "a", "a.svg.gz"] {
            let e = PlotFormat::of_path(Path::new(name), flag).unwrap_err();
            let text = format!("{e:#}");
            assert!(
                text.contains(&format!("--corner {name}")) && text.contains(".png or .svg"),
                "{text}"
            );
            let out = dir.path().join(name);
            assert!(write_figure(&Small, &out).is_err());
            assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "{name}");
        }
        // Both formats are written whole, with no temporary file left.
        write_figure(&Small, &dir.path().join("a.svg")).unwrap();
        write_figure(&Small, &dir.path().join("a.png")).unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
        let png = std::fs::read(dir.path().join("a.png")).unwrap();
        assert_eq!(&png[..4], b"\x89PNG");
        let texts = svg_texts(&dir.path().join("a.svg"));
        assert!(texts.iter().any(|t| t == "x <&> y"), "{texts:?}");
    }
}

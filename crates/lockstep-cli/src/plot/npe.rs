//! The figures of `lockstep npe`: the P-P plot of `lockstep npe pp` and the corner plot of
//! `lockstep npe sample --corner`, as PNG or SVG ([`write_figure`]).

use super::figure::{write_figure, Figure};
use super::style::{font, COLOURS};
use anyhow::{bail, Result};
use lockstep_npe::calibration::PpResult;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

/// The P-P plot: per parameter, the fraction of injections whose true value lies at or
/// below each credible level of its marginal posterior, against the level; the diagonal and
/// the 68/95/99.7% binomial bands of a calibrated posterior with this many injections (as
/// bilby's `make_pp_plot`, normal approximation). Written atomically as PNG or SVG, as
/// `out`'s extension says.
///
/// Errors: an extension other than .png or .svg, drawing or writing fails.
pub fn plot_pp(r: &PpResult, out: &Path, title: &str) -> Result<()> {
    write_figure(&PpFigure { r, title }, out)
}

/// The P-P plot of [`plot_pp`].
struct PpFigure<'a> {
    r: &'a PpResult,
    title: &'a str,
}

impl Figure for PpFigure<'_> {
    fn size(&self) -> (u32, u32) {
        (700, 700)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        let (r, title) = (self.r, self.title);
        let n = r.percentiles.len() as f64;
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(root)
            .margin(15)
            .caption(
                format!("P-P plot, {title}, {} injections", r.percentiles.len()),
                font(22),
            )
            .x_label_area_size(45)
            .y_label_area_size(55)
            .build_cartesian_2d(0.0f64..1.0, 0.0f64..1.0)?;
        chart
            .configure_mesh()
            .x_desc("credible level")
            .y_desc("fraction of injections in the credible interval")
            .light_line_style(WHITE)
            .label_style(font(14))
            .draw()?;
        let grid: Vec<f64> = (0..=200).map(|i| i as f64 / 200.0).collect();
        for (z, shade) in [(3.0, 235u8), (1.96, 220), (1.0, 200)] {
            let upper: Vec<(f64, f64)> = grid
                .iter()
                .map(|&p| (p, (p + z * (p * (1.0 - p) / n).sqrt()).min(1.0)))
                .collect();
            let lower: Vec<(f64, f64)> = grid
                .iter()
                .rev()
                .map(|&p| (p, (p - z * (p * (1.0 - p) / n).sqrt()).max(0.0)))
                .collect();
            chart.draw_series(std::iter::once(Polygon::new(
                upper.into_iter().chain(lower).collect::<Vec<_>>(),
                RGBColor(shade, shade, shade).filled(),
            )))?;
        }
        chart.draw_series(LineSeries::new(
            [(0.0, 0.0), (1.0, 1.0)],
            BLACK.stroke_width(1),
        ))?;
        for (j, name) in r.names.iter().enumerate() {
            let mut col = r.column(j);
            col.sort_by(f64::total_cmp);
            let colour = COLOURS[j % COLOURS.len()];
            let pts: Vec<(f64, f64)> = grid
                .iter()
                .map(|&p| (p, col.partition_point(|&v| v <= p) as f64 / n))
                .collect();
            chart
                .draw_series(LineSeries::new(pts, colour.stroke_width(2)))?
                .label(format!("{name} (p = {:.3})", r.p_values[j]))
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(font(14))
            .draw()?;
        Ok(())
    }
}

/// The axis range of one parameter in a corner plot: its 0.5% to 99.5% sample quantiles,
/// widened to hold the true value, with a 5% margin.
fn corner_range(values: &mut [f64], truth: Option<f64>) -> (f64, f64) {
    values.sort_by(f64::total_cmp);
    let q = |p: f64| values[((values.len() - 1) as f64 * p).round() as usize];
    let (mut lo, mut hi) = (q(0.005), q(0.995));
    if let Some(t) = truth.filter(|t| t.is_finite()) {
        lo = lo.min(t);
        hi = hi.max(t);
    }
    let pad = 0.05 * (hi - lo).max(1e-12 * lo.abs().max(1.0));
    (lo - pad, hi + pad)
}

/// A corner plot of posterior samples (`[n * d]` row-major): per parameter a histogram on
/// the diagonal; below it, per pair, a 2-D histogram (40 x 40 bins, darker = more samples);
/// the true values, when given, as red lines and points. Written atomically as PNG or SVG,
/// as `out`'s extension says.
///
/// Errors: fewer than 2 samples or no parameter, an extension other than .png or .svg,
/// drawing or writing fails.
pub fn plot_corner(
    samples: &[f32],
    names: &[String],
    truth: Option<&[f64]>,
    title: &str,
    out: &Path,
) -> Result<()> {
    let d = names.len();
    let n = samples.len() / d.max(1);
    if d == 0 || n < 2 {
        bail!("a corner plot needs at least 2 samples of at least 1 parameter");
    }
    let column = |j: usize| -> Vec<f64> {
        samples
            .iter()
            .skip(j)
            .step_by(d)
            .map(|&v| v as f64)
            .collect()
    };
    let columns: Vec<Vec<f64>> = (0..d).map(column).collect();
    let ranges: Vec<(f64, f64)> = (0..d)
        .map(|j| corner_range(&mut columns[j].clone(), truth.map(|t| t[j])))
        .collect();
    let figure = CornerFigure {
        columns,
        ranges,
        names,
        truth,
        title: format!("{title}: {n} posterior samples"),
    };
    write_figure(&figure, out)
}

/// The corner plot of [`plot_corner`]: each parameter's samples, its axis range, name and
/// true value.
struct CornerFigure<'a> {
    columns: Vec<Vec<f64>>,
    ranges: Vec<(f64, f64)>,
    names: &'a [String],
    truth: Option<&'a [f64]>,
    title: String,
}

/// The side of one panel of a corner plot, in pixels.
const CORNER_PANEL: u32 = 190;

impl Figure for CornerFigure<'_> {
    fn size(&self) -> (u32, u32) {
        let d = self.names.len() as u32;
        (CORNER_PANEL * d + 40, CORNER_PANEL * d + 70)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        let (d, names, truth) = (self.names.len(), self.names, self.truth);
        root.fill(&WHITE)?;
        let root = root.titled(&self.title, font(20))?;
        let areas = root.split_evenly((d, d));
        for i in 0..d {
            for j in 0..=i {
                let panel = CornerPanel {
                    area: &areas[i * d + j],
                    x_range: self.ranges[j],
                    y_range: self.ranges[i],
                    x_label: if i + 1 == d { names[j].as_str() } else { "" },
                    y_label: if j == 0 && i != j {
                        names[i].as_str()
                    } else {
                        ""
                    },
                    bottom: i + 1 == d,
                    left: j == 0,
                };
                if i == j {
                    corner_histogram(&panel, &self.columns[j], truth.map(|t| t[j]))?;
                } else {
                    corner_pair(
                        &panel,
                        &self.columns[j],
                        &self.columns[i],
                        truth.map(|t| (t[j], t[i])),
                    )?;
                }
            }
        }
        Ok(())
    }
}

/// Histogram bins per axis of a corner plot's panels.
const CORNER_BINS: usize = 40;

/// The bin of `v` in `[lo, hi)` split into [`CORNER_BINS`] bins (`None` outside).
fn corner_bin(v: f64, (lo, hi): (f64, f64)) -> Option<usize> {
    let b = ((v - lo) / (hi - lo) * CORNER_BINS as f64).floor();
    (b >= 0.0 && b < CORNER_BINS as f64).then_some(b as usize)
}

/// One panel of a corner plot: its drawing area, axis ranges and labels, and whether it sits
/// on the bottom row (x tick labels) or the left column (y tick labels).
struct CornerPanel<'a, DB: DrawingBackend> {
    area: &'a DrawingArea<DB, Shift>,
    x_range: (f64, f64),
    y_range: (f64, f64),
    x_label: &'a str,
    y_label: &'a str,
    bottom: bool,
    left: bool,
}

const CORNER_RED: RGBColor = RGBColor(214, 39, 40);

/// A diagonal panel: the histogram of one parameter's samples, the true value as a red line.
fn corner_histogram<DB: DrawingBackend>(
    p: &CornerPanel<DB>,
    values: &[f64],
    truth: Option<f64>,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let xr = p.x_range;
    let mut counts = [0u32; CORNER_BINS];
    for &v in values {
        if let Some(b) = corner_bin(v, xr) {
            counts[b] += 1;
        }
    }
    let top = *counts.iter().max().unwrap_or(&1) as f64 * 1.1;
    let mut chart = ChartBuilder::on(p.area)
        .margin(4)
        .x_label_area_size(if p.bottom { 38 } else { 14 })
        .y_label_area_size(if p.left { 46 } else { 8 })
        .build_cartesian_2d(xr.0..xr.1, 0.0..top.max(1.0))?;
    chart
        .configure_mesh()
        .disable_mesh()
        .y_labels(0)
        .x_labels(3)
        .x_desc(p.x_label)
        .label_style(font(11))
        .draw()?;
    let w = (xr.1 - xr.0) / CORNER_BINS as f64;
    let blue = COLOURS[0];
    chart.draw_series(counts.iter().enumerate().map(|(b, &c)| {
        let x0 = xr.0 + b as f64 * w;
        Rectangle::new([(x0, 0.0), (x0 + w, c as f64)], blue.mix(0.6).filled())
    }))?;
    if let Some(t) = truth {
        chart.draw_series(std::iter::once(PathElement::new(
            [(t, 0.0), (t, top)],
            CORNER_RED.stroke_width(2),
        )))?;
    }
    Ok(())
}

/// A panel below the diagonal: the 2-D histogram of a pair of parameters (darker = more
/// samples), the true values as red lines and a point.
fn corner_pair<DB: DrawingBackend>(
    p: &CornerPanel<DB>,
    xs: &[f64],
    ys: &[f64],
    truth: Option<(f64, f64)>,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let (xr, yr) = (p.x_range, p.y_range);
    let mut grid = vec![0u32; CORNER_BINS * CORNER_BINS];
    for (&x, &y) in xs.iter().zip(ys) {
        if let (Some(bx), Some(by)) = (corner_bin(x, xr), corner_bin(y, yr)) {
            grid[by * CORNER_BINS + bx] += 1;
        }
    }
    let most = *grid.iter().max().unwrap_or(&1) as f64;
    let mut chart = ChartBuilder::on(p.area)
        .margin(4)
        .x_label_area_size(if p.bottom { 38 } else { 14 })
        .y_label_area_size(if p.left { 46 } else { 8 })
        .build_cartesian_2d(xr.0..xr.1, yr.0..yr.1)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .x_labels(3)
        .y_labels(if p.left { 3 } else { 0 })
        .x_desc(p.x_label)
        .y_desc(p.y_label)
        .label_style(font(11))
        .draw()?;
    let (wx, wy) = (
        (xr.1 - xr.0) / CORNER_BINS as f64,
        (yr.1 - yr.0) / CORNER_BINS as f64,
    );
    chart.draw_series(
        grid.iter()
            .enumerate()
            .filter(|(_, &c)| c > 0)
            .map(|(k, &c)| {
                let (bx, by) = ((k % CORNER_BINS) as f64, (k / CORNER_BINS) as f64);
                let shade = (c as f64 / most).sqrt();
                let level = (255.0 * (1.0 - 0.85 * shade)) as u8;
                let (x0, y0) = (xr.0 + bx * wx, yr.0 + by * wy);
                Rectangle::new(
                    [(x0, y0), (x0 + wx, y0 + wy)],
                    RGBColor(level, level, 255).filled(),
                )
            }),
    )?;
    if let Some((tx, ty)) = truth {
        chart.draw_series([
            PathElement::new([(tx, yr.0), (tx, yr.1)], CORNER_RED.stroke_width(1)),
            PathElement::new([(xr.0, ty), (xr.1, ty)], CORNER_RED.stroke_width(1)),
        ])?;
        chart.draw_series(std::iter::once(Circle::new(
            (tx, ty),
            3,
            CORNER_RED.filled(),
        )))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plot::figure::tests::svg_texts;

    /// A corner plot of 2 parameters, as SVG: well-formed, with the title, the axis labels
    /// and tick labels whose decimal point is a plain ".".
    #[test]
    fn the_corner_plot_is_written_as_svg_with_its_labels() {
        let dir = tempfile::tempdir().unwrap();
        let names = vec!["chirp_mass".to_string(), "eta".to_string()];
        let samples: Vec<f32> = (0..2000)
            .flat_map(|i| {
                let u = (i as f32 * 0.618).fract();
                [21.0 + 2.0 * u, 0.2 + 0.04 * (1.0 - u)]
            })
            .collect();
        let out = dir.path().join("corner.svg");
        plot_corner(&samples, &names, Some(&[22.0, 0.22]), "gw chirp", &out).unwrap();
        let texts = svg_texts(&out);
        for want in [
            "gw chirp: 2000 posterior samples",
            "chirp_mass",
            "eta",
            "22.0",
        ] {
            assert!(texts.iter().any(|t| t == want), "{want} not in {texts:?}");
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    /// The P-P plot as SVG: well-formed, with its title, axis labels, tick labels and
    /// legend.
    #[test]
    fn the_pp_plot_is_written_as_svg_with_its_labels() {
        let dir = tempfile::tempdir().unwrap();
        let percentiles: Vec<Vec<f64>> = (0..50)
            .map(|i| vec![(i as f64 + 0.5) / 50.0, ((i * 7 % 50) as f64 + 0.5) / 50.0])
            .collect();
        let r = PpResult {
            names: vec!["theta_1".into(), "theta_2".into()],
            truths: vec![vec![0.0, 0.0]; 50],
            percentiles,
            p_values: vec![0.5, 0.25],
        };
        let out = dir.path().join("pp.svg");
        plot_pp(&r, &out, "gaussian").unwrap();
        let texts = svg_texts(&out);
        for want in [
            "P-P plot, gaussian, 50 injections",
            "credible level",
            "fraction of injections in the credible interval",
            "theta_1 (p = 0.500)",
            "theta_2 (p = 0.250)",
            "0.5",
        ] {
            assert!(texts.iter().any(|t| t == want), "{want} not in {texts:?}");
        }
    }
}

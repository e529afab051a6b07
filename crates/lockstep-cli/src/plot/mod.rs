//! `lockstep plot PATH`: figures of a training run or a simulation — the loss curves of
//! `callbacks/losses.csv`, a raster of one training trial (the latest
//! `spikes/update_NNNNNN.h5` that `output.training_spikes` wrote) and a spike raster of a
//! SONATA spikes file (`spikes.h5`) or BMTK's spikes CSV (`spikes.csv`,
//! `timestamps population node_ids`).
//! Every figure is written as PNG or, with `--plot-format svg`, as SVG (vector output, from
//! the same drawing code: [`figure`]).
//! Text is drawn with the bundled DejaVu Sans font (assets/, Bitstream Vera/DejaVu license),
//! so no system font is needed ([`style`]). The figures of `lockstep npe sample --corner` and
//! `lockstep npe pp` are in [`npe`].

pub mod figure;
pub mod npe;
mod style;

use anyhow::{bail, Context, Result};
use figure::{write_figure, Figure, PlotFormat};
use lockstep_sonata::{PopulationSpikes, SpikeSorting, SpikeTrains};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};
use style::{font, COLOURS};

/// Options of `lockstep plot`.
#[derive(Debug, clap::Args)]
pub struct PlotArgs {
    /// A training run's output directory (callbacks/losses.csv), a simulation's output
    /// folder (spikes.h5 or spikes.csv), or a spikes file (.h5 or .csv).
    pub run_dir: PathBuf,
    /// The spikes file for the raster (default: spikes.h5, else spikes.csv, in the folder).
    #[arg(long)]
    pub spikes: Option<PathBuf>,
    /// The figures' file format: png, or svg (vector graphics, for papers).
    #[arg(long, value_enum, default_value = "png")]
    pub plot_format: PlotFormat,
}

/// Writes `plots/losses.png` when there are losses, `plots/training_raster.png` when a
/// training run recorded trials (`spikes/update_NNNNNN.h5`, the latest update) and
/// `plots/raster.png` when there are spikes (into the folder, or next to a spikes file given
/// as the path); `.svg` files instead with `--plot-format svg`.
///
/// Errors: nothing to plot, unreadable or malformed files (naming file and line).
pub fn run(args: &PlotArgs) -> Result<()> {
    let ext = args.plot_format.extension();
    let (folder, spikes) = if args.run_dir.is_file() {
        let parent = args
            .run_dir
            .parent()
            .unwrap_or(Path::new("."))
            .to_path_buf();
        (parent, Some(args.run_dir.clone()))
    } else {
        let found = ["spikes.h5", "spikes.csv"]
            .iter()
            .map(|n| args.run_dir.join(n))
            .find(|p| p.is_file());
        (args.run_dir.clone(), args.spikes.clone().or(found))
    };
    let csv = folder.join("callbacks/losses.csv");
    let has_losses = csv.is_file() && !args.run_dir.is_file();
    if !has_losses && spikes.is_none() {
        bail!(
            "{}: nothing to plot: it holds neither callbacks/losses.csv (a training run) nor spikes.h5 or spikes.csv (a simulation); pass a run directory, a simulation output folder or a spikes file",
            args.run_dir.display()
        );
    }
    let losses = if has_losses {
        Some(read_losses(&csv)?)
    } else {
        None
    };
    let trains = match &spikes {
        Some(p) => Some(read_any_spikes(p)?),
        None => None,
    };
    let training = if has_losses {
        latest_training_trial(&folder)?
    } else {
        None
    };
    let plots = folder.join("plots");
    std::fs::create_dir_all(&plots)
        .with_context(|| format!("cannot create {}", plots.display()))?;
    if let Some(losses) = losses {
        let out = plots.join(format!("losses.{ext}"));
        plot_losses(losses, &out)?;
        println!("wrote {}", out.display());
    }
    if let Some((update, path)) = &training {
        let t = read_any_spikes(path)?;
        if t.populations.iter().all(|p| p.node_ids.is_empty()) {
            println!(
                "no training raster: the training trial of update {update} ({}) has no spikes",
                path.display()
            );
        } else {
            let out = plots.join(format!("training_raster.{ext}"));
            let title = format!("training trial at update {update} (first sample)");
            plot_raster(&t, path, &title, &out)?;
            println!("wrote {}", out.display());
        }
    }
    match (trains, &spikes) {
        (Some(t), Some(p)) => {
            let out = plots.join(format!("raster.{ext}"));
            plot_raster(&t, p, "spikes", &out)?;
            println!("wrote {}", out.display());
        }
        _ if training.is_some() => {}
        _ if has_losses => println!(
            "no spike raster: {} has no recorded training trials (set output.training_spikes, e.g. {{\"every\": 50}}) and no spikes.h5 or spikes.csv (pass --spikes FILE)",
            folder.display()
        ),
        _ => println!(
            "no spike raster: {} has no spikes.h5 or spikes.csv (pass --spikes FILE)",
            folder.display()
        ),
    }
    Ok(())
}

/// The latest training trial a run recorded: the highest `N` of
/// `RUN_DIR/spikes/update_NNNNNN.h5` (`output.training_spikes`), with its path.
///
/// Errors: an unreadable `spikes/` folder.
fn latest_training_trial(run_dir: &Path) -> Result<Option<(u64, PathBuf)>> {
    let folder = run_dir.join(lockstep_snn::TRAINING_SPIKES_DIR);
    if !folder.is_dir() {
        return Ok(None);
    }
    let mut latest = None;
    for e in
        std::fs::read_dir(&folder).with_context(|| format!("cannot read {}", folder.display()))?
    {
        let path = e
            .with_context(|| format!("cannot read {}", folder.display()))?
            .path();
        let update = lockstep_snn::TrainingSpikes::update_of(&path);
        if let Some(u) = update {
            if latest.as_ref().is_none_or(|(v, _)| u > *v) {
                latest = Some((u, path));
            }
        }
    }
    Ok(latest)
}

/// Reads a spikes file lockstep writes: SONATA HDF5 (recognised by its signature) or
/// BMTK's CSV (`timestamps population node_ids`, space, tab or comma separated).
///
/// Errors: unreadable file; a CSV without those columns or with a malformed row (naming the
/// line).
fn read_any_spikes(path: &Path) -> Result<SpikeTrains> {
    let mut head = [0u8; 8];
    let n = std::io::Read::read(
        &mut std::fs::File::open(path)
            .with_context(|| format!("cannot open {}", path.display()))?,
        &mut head,
    )
    .with_context(|| format!("cannot read {}", path.display()))?;
    if head[..n] == b"\x89HDF\r\n\x1a\n"[..n.min(8)] && n == 8 {
        return Ok(lockstep_sonata::read_spikes(path)?);
    }
    let text = std::fs::read_to_string(path).with_context(|| {
        format!(
            "cannot read {} (neither a SONATA HDF5 nor a text spikes file)",
            path.display()
        )
    })?;
    parse_spikes_csv(&text).with_context(|| format!("{}", path.display()))
}

/// Parses BMTK's spikes CSV: a header naming `timestamps` (ms), `node_ids` and optionally
/// `population`, then one spike per row.
fn parse_spikes_csv(text: &str) -> Result<SpikeTrains> {
    let split = |l: &str| -> Vec<String> {
        l.split(|c: char| c == ',' || c.is_whitespace())
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    };
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    let (_, header) = lines.next().context("empty file")?;
    let cols = split(header);
    let col = |name: &str| cols.iter().position(|c| c == name);
    let (Some(t), Some(id)) = (col("timestamps"), col("node_ids")) else {
        bail!("line 1: header {cols:?} lacks the columns timestamps and node_ids (BMTK's spikes CSV: timestamps population node_ids)");
    };
    let pop = col("population");
    let mut populations: Vec<PopulationSpikes> = Vec::new();
    for (i, line) in lines {
        let f = split(line);
        let bad = || anyhow::anyhow!("line {}: not a spike row: {line:?}", i + 1);
        let time: f64 = f.get(t).and_then(|v| v.parse().ok()).ok_or_else(bad)?;
        let node: u64 = f.get(id).and_then(|v| v.parse().ok()).ok_or_else(bad)?;
        let name = match pop {
            Some(p) => f.get(p).ok_or_else(bad)?.clone(),
            None => lockstep_sonata::LEGACY_POPULATION.to_string(),
        };
        let idx = match populations.iter().position(|p| p.population == name) {
            Some(k) => k,
            None => {
                populations.push(PopulationSpikes {
                    population: name,
                    node_ids: Vec::new(),
                    timestamps: Vec::new(),
                    sorting: SpikeSorting::None,
                });
                populations.len() - 1
            }
        };
        populations[idx].node_ids.push(node);
        populations[idx].timestamps.push(time);
    }
    Ok(SpikeTrains { populations })
}

/// Tick values for a log axis over `[lo, hi]` (`0 < lo < hi`): powers of ten, with 2x and
/// 5x added while fewer than 3 fall in the range; for a span below about half a decade,
/// evenly spaced round values. Always at least 2 ticks inside the range, at most 10.
pub fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let (a, b) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    for mults in [&[1.0][..], &[1.0, 2.0, 5.0][..]] {
        let ticks: Vec<f64> = (a..=b)
            .flat_map(|e| mults.iter().map(move |m| m * 10f64.powi(e)))
            .filter(|v| *v >= lo && *v <= hi)
            .collect();
        if ticks.len() >= 3 {
            let stride = ticks.len().div_ceil(10);
            return ticks.into_iter().step_by(stride).collect();
        }
    }
    linear_ticks(lo, hi, 5)
}

/// About `target` round values (1, 2 or 5 times a power of ten apart) inside `[lo, hi]`.
pub fn linear_ticks(lo: f64, hi: f64, target: usize) -> Vec<f64> {
    let step = nice_step((hi - lo) / target.max(1) as f64);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step).floor() as i64;
    (first..=last).map(|k| k as f64 * step).collect()
}

/// The round step (1, 2 or 5 times a power of ten) nearest above `raw`.
fn nice_step(raw: f64) -> f64 {
    let raw = if raw > 0.0 && raw.is_finite() {
        raw
    } else {
        1.0
    };
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|s| *s >= raw * 0.999)
        .unwrap_or(10.0 * p)
}

/// Integer update ticks from 0 to `last` (about 8, at round steps of at least 1).
pub fn update_ticks(last: u64) -> Vec<u64> {
    let step = nice_step(last.max(1) as f64 / 8.0).max(1.0) as u64;
    (0..=last).step_by(step as usize).collect()
}

/// A tick label with just enough digits to tell ticks `step` apart.
pub fn tick_label(v: f64, step: f64) -> String {
    if v == 0.0 {
        return "0".to_string();
    }
    let mag = v.abs().log10().floor() as i32;
    let step_mag = step.abs().max(f64::MIN_POSITIVE).log10().floor() as i32;
    if (-3..5).contains(&mag) {
        format!("{v:.*}", (-step_mag).max(0) as usize)
    } else {
        format!("{v:.*e}", (mag - step_mag).clamp(0, 6) as usize)
    }
}

/// A linear or log axis whose labelled ticks are exactly `ticks` (plotters' own log axis
/// labels nothing on a span below a decade).
#[derive(Debug, Clone)]
struct TickedAxis {
    range: std::ops::Range<f64>,
    log: bool,
    ticks: Vec<f64>,
}

impl plotters::coord::ranged1d::Ranged for TickedAxis {
    type FormatOption = plotters::coord::ranged1d::DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let f = |v: f64| {
            if self.log {
                v.max(f64::MIN_POSITIVE).ln()
            } else {
                v
            }
        };
        let (a, b) = (f(self.range.start), f(self.range.end));
        let t = if b > a {
            (f(*value) - a) / (b - a)
        } else {
            0.5
        };
        limit.0 + (t * (limit.1 - limit.0) as f64).round() as i32
    }

    fn key_points<H: plotters::coord::ranged1d::KeyPointHint>(&self, _hint: H) -> Vec<f64> {
        self.ticks.clone()
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.range.clone()
    }
}

/// The smallest gap between consecutive ticks (for [`tick_label`]).
fn min_gap(ticks: &[f64]) -> f64 {
    ticks
        .windows(2)
        .map(|w| w[1] - w[0])
        .fold(f64::INFINITY, f64::min)
        .min(ticks.first().map_or(1.0, |t| t.abs()))
}

/// Reads `losses.csv` (`step,epoch,<terms...>,total`): the column names and the rows.
fn read_losses(csv: &Path) -> Result<(Vec<String>, Vec<Vec<f64>>)> {
    let text =
        std::fs::read_to_string(csv).with_context(|| format!("cannot read {}", csv.display()))?;
    let mut lines = text.lines();
    let header: Vec<String> = lines
        .next()
        .with_context(|| format!("{} is empty", csv.display()))?
        .split(',')
        .map(str::to_string)
        .collect();
    if header.len() < 3 || header[0] != "step" {
        bail!(
            "{}: not a lockstep losses.csv (header {:?})",
            csv.display(),
            header
        );
    }
    let mut rows = Vec::new();
    for (i, line) in lines.enumerate() {
        let row: Vec<f64> = line
            .split(',')
            .map(|v| v.trim().parse::<f64>())
            .collect::<Result<_, _>>()
            .with_context(|| format!("{} line {}: not numbers: {line:?}", csv.display(), i + 2))?;
        if row.len() != header.len() {
            bail!(
                "{} line {}: {} values, header has {}",
                csv.display(),
                i + 2,
                row.len(),
                header.len()
            );
        }
        rows.push(row);
    }
    if rows.is_empty() {
        bail!("{} has no rows yet", csv.display());
    }
    Ok((header, rows))
}

/// One panel per loss column (each term and the total), each with its own log axis and its
/// own labelled ticks ([`log_ticks`]), integer update ticks, colours from [`COLOURS`];
/// written as PNG or SVG as `out`'s extension says.
fn plot_losses((header, rows): (Vec<String>, Vec<Vec<f64>>), out: &Path) -> Result<()> {
    // Only finite positive values can be drawn on a log axis.
    let finite = |x: &f64| x.is_finite() && *x > 0.0;
    let series: Vec<(String, Vec<f64>)> = (2..header.len())
        .map(|c| (header[c].clone(), rows.iter().map(|r| r[c]).collect()))
        .filter(|(_, v): &(String, Vec<f64>)| v.iter().any(finite))
        .collect();
    let steps: Vec<f64> = rows.iter().map(|r| r[0]).collect();
    write_figure(&LossFigure { steps, series }, out)
}

/// The loss curves of [`plot_losses`]: the update of each row, and per loss column with a
/// finite positive value its name and values.
struct LossFigure {
    steps: Vec<f64>,
    series: Vec<(String, Vec<f64>)>,
}

impl Figure for LossFigure {
    fn size(&self) -> (u32, u32) {
        (1000, 220 * self.series.len().max(1) as u32 + 60)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        let (steps, series) = (&self.steps, &self.series);
        let x_max = steps.iter().cloned().fold(1.0, f64::max).ceil();
        // Each axis spans at most 12 decades below its largest value (a log axis reaching
        // inf or 1e-300 has no usable ticks).
        let finite = |x: &f64| x.is_finite() && *x > 0.0;
        let panels = series.len().max(1);
        root.fill(&WHITE)?;
        let root = root.titled("training loss", font(28))?;
        let areas = root.split_evenly((panels, 1));
        let x_ticks: Vec<f64> = update_ticks(x_max as u64)
            .into_iter()
            .map(|u| u as f64)
            .collect();
        for (i, ((name, values), area)) in series.iter().zip(areas.iter()).enumerate() {
            let (lo, hi) = values
                .iter()
                .filter(|x| finite(x))
                .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
            let (lo, hi) = if lo < hi {
                (lo, hi)
            } else {
                (lo * 0.9, hi * 1.1)
            };
            let (lo, hi) = ((lo / 1.05).max(hi * 1e-12), hi * 1.05);
            let y_ticks = log_ticks(lo, hi);
            let y_gap = min_gap(&y_ticks);
            let mut chart = ChartBuilder::on(area)
                .margin(10)
                .x_label_area_size(35)
                .y_label_area_size(95)
                .caption(name, font(20))
                .build_cartesian_2d(
                    TickedAxis {
                        range: 0.0..x_max,
                        log: false,
                        ticks: x_ticks.clone(),
                    },
                    TickedAxis {
                        range: lo..hi,
                        log: true,
                        ticks: y_ticks,
                    },
                )?;
            chart
                .configure_mesh()
                .x_desc("optimizer update")
                .x_label_formatter(&|v| format!("{v:.0}"))
                .y_label_formatter(&|v| tick_label(*v, y_gap))
                .label_style(font(14))
                .draw()?;
            let color = COLOURS[i % COLOURS.len()];
            chart.draw_series(LineSeries::new(
                steps
                    .iter()
                    .zip(values)
                    .filter(|(_, v)| finite(v) && **v >= lo)
                    .map(|(s, v)| (*s, *v)),
                color.stroke_width(2),
            ))?;
        }
        Ok(())
    }
}

/// A raster of `trains` (read from `spikes`) titled `title: populations (N spikes)`, written
/// as PNG or SVG as `out`'s extension says (an SVG holds one element per spike).
fn plot_raster(trains: &SpikeTrains, spikes: &Path, title: &str, out: &Path) -> Result<()> {
    let mut points = Vec::new();
    let mut labels = Vec::new();
    for pop in &trains.populations {
        labels.push(pop.population.clone());
        points.extend(
            pop.timestamps
                .iter()
                .zip(&pop.node_ids)
                .map(|(t, n)| (*t, *n as f64)),
        );
    }
    if points.is_empty() {
        bail!("{} holds no spikes", spikes.display());
    }
    let title = format!("{title}: {} ({} spikes)", labels.join(", "), points.len());
    write_figure(&RasterFigure { points, title }, out)
}

/// The raster of [`plot_raster`]: (time in ms, node id) per spike, and the title.
struct RasterFigure {
    points: Vec<(f64, f64)>,
    title: String,
}

impl Figure for RasterFigure {
    fn size(&self) -> (u32, u32) {
        (1000, 600)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        let points = &self.points;
        let t_max = points.iter().map(|p| p.0).fold(1.0, f64::max);
        let n_max = points.iter().map(|p| p.1).fold(1.0, f64::max) + 1.0;
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, font(24))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..t_max, 0.0..n_max)?;
        chart
            .configure_mesh()
            .x_desc("time (ms)")
            .y_desc("node id")
            .y_label_formatter(&|v| format!("{v:.0}"))
            .label_style(font(16))
            .draw()?;
        chart.draw_series(
            points
                .iter()
                .map(|&(t, n)| Circle::new((t, n), 1, BLACK.filled())),
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_axes_get_labelled_ticks_at_any_range() {
        for (lo, hi) in [
            (125.0, 140.0),
            (100.0, 400.0),
            (0.9, 1.2),
            (3e-7, 2e3),
            (1.0001e-3, 1.0004e-3),
            (7.0, 70.0),
        ] {
            let t = log_ticks(lo, hi);
            assert!(t.len() >= 2 && t.len() <= 10, "{lo}..{hi}: {t:?}");
            assert!(t.iter().all(|v| *v >= lo && *v <= hi), "{lo}..{hi}: {t:?}");
            let labels: Vec<String> = t.iter().map(|v| tick_label(*v, min_gap(&t))).collect();
            let mut unique = labels.clone();
            unique.dedup();
            assert_eq!(unique, labels, "{lo}..{hi}: labels repeat");
        }
        assert_eq!(log_ticks(1e-3, 2e1), vec![1e-3, 1e-2, 1e-1, 1.0, 10.0]);
        assert_eq!(tick_label(130.0, 5.0), "130");
        assert_eq!(tick_label(0.25, 0.05), "0.25");
        assert_eq!(tick_label(1.5e-6, 1e-7), "1.5e-6");
    }

    #[test]
    fn update_ticks_are_integers() {
        assert_eq!(update_ticks(2), vec![0, 1, 2]);
        assert_eq!(update_ticks(20), vec![0, 5, 10, 15, 20]);
        assert!(update_ticks(1000).len() <= 11);
    }

    #[test]
    fn colours_read_on_white() {
        for c in COLOURS {
            // Relative luminance (ITU-R BT.709) well below white's, and not yellow.
            let l = 0.2126 * c.0 as f64 + 0.7152 * c.1 as f64 + 0.0722 * c.2 as f64;
            assert!(l < 180.0, "{c:?} is too light on white");
            assert!(!(c.0 > 150 && c.1 > 150 && c.2 < 100), "{c:?} is yellow");
        }
    }

    /// The loss curves and a raster, as SVG: well-formed, with their titles, axis labels and
    /// tick labels (a plain "." as the decimal point).
    #[test]
    fn losses_and_rasters_are_written_as_svg_with_their_labels() {
        use figure::tests::svg_texts;
        let dir = tempfile::tempdir().unwrap();
        let header: Vec<String> = ["step", "epoch", "rate", "total"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let rows: Vec<Vec<f64>> = (0..20)
            .map(|i| {
                let l = 0.8 * 0.9f64.powi(i);
                vec![i as f64, 0.0, l, l + 0.1]
            })
            .collect();
        let out = dir.path().join("losses.svg");
        plot_losses((header, rows), &out).unwrap();
        let texts = svg_texts(&out);
        for want in [
            "training loss",
            "rate",
            "total",
            "optimizer update",
            "0.2",
            "15",
        ] {
            assert!(texts.iter().any(|t| t == want), "{want} not in {texts:?}");
        }
        let trains =
            parse_spikes_csv("timestamps population node_ids\n1.5 v1 3\n220.0 v1 9\n").unwrap();
        let out = dir.path().join("raster.svg");
        plot_raster(&trains, Path::new("spikes.csv"), "spikes", &out).unwrap();
        let texts = svg_texts(&out);
        for want in ["spikes: v1 (2 spikes)", "time (ms)", "node id", "200.0"] {
            assert!(texts.iter().any(|t| t == want), "{want} not in {texts:?}");
        }
        let svg = std::fs::read_to_string(&out).unwrap();
        assert_eq!(svg.matches("<circle").count(), 2, "one circle per spike");
    }

    #[test]
    fn bmtk_spike_csv_parses() {
        let t = parse_spikes_csv("timestamps population node_ids\n1.5 v1 3\n2.0 lgn 0\n2.5 v1 4\n")
            .unwrap();
        assert_eq!(t.populations.len(), 2);
        assert_eq!(t.populations[0].node_ids, vec![3, 4]);
        assert_eq!(t.populations[0].timestamps, vec![1.5, 2.5]);
        let e = parse_spikes_csv("timestamps population node_ids\n1.5 v1 x\n").unwrap_err();
        assert!(format!("{e:#}").contains("line 2"), "{e:#}");
    }
}

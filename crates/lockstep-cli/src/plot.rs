//! `lockstep plot RUN_DIR`: PNG figures of a training run — the loss curves of
//! `callbacks/losses.csv` and a spike raster of an inference run's SONATA spikes file.
//! Text is drawn with the bundled DejaVu Sans font (assets/, Bitstream Vera/DejaVu license),
//! so no system font is needed.

use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use plotters::style::FontStyle;
use std::path::{Path, PathBuf};

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// Options of `lockstep plot`.
#[derive(Debug, clap::Args)]
pub struct PlotArgs {
    /// A training run's output directory (holds callbacks/losses.csv).
    pub run_dir: PathBuf,
    /// The SONATA spikes file for the raster (default: RUN_DIR/spikes.h5 when present).
    #[arg(long)]
    pub spikes: Option<PathBuf>,
}

/// Writes `RUN_DIR/plots/losses.png` and, when a spikes file is found, `raster.png`.
pub fn run(args: &PlotArgs) -> Result<()> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| anyhow::anyhow!("the bundled font cannot be loaded"))?;
    let csv = args.run_dir.join("callbacks/losses.csv");
    let losses = read_losses(&csv)?;
    let plots = args.run_dir.join("plots");
    std::fs::create_dir_all(&plots)
        .with_context(|| format!("cannot create {}", plots.display()))?;
    let out = plots.join("losses.png");
    plot_losses(losses, &out)?;
    println!("wrote {}", out.display());
    let spikes = match &args.spikes {
        Some(p) => Some(p.clone()),
        None => Some(args.run_dir.join("spikes.h5")).filter(|p| p.exists()),
    };
    match spikes {
        Some(p) => {
            let out = plots.join("raster.png");
            plot_raster(&p, &out)?;
            println!("wrote {}", out.display());
        }
        None => println!(
            "no spike raster: {} has no spikes.h5 (pass --spikes FILE)",
            args.run_dir.display()
        ),
    }
    Ok(())
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

/// One panel per loss column (each term and the total), each with its own log axis, so
/// terms of very different size are all visible.
fn plot_losses((header, rows): (Vec<String>, Vec<Vec<f64>>), out: &Path) -> Result<()> {
    let steps: Vec<f64> = rows.iter().map(|r| r[0]).collect();
    let x_max = steps.iter().cloned().fold(1.0, f64::max);
    // Only finite positive values can be drawn on a log axis; each axis spans at most 12
    // decades below its largest value (a log axis reaching inf or 1e-300 has no usable ticks).
    let finite = |x: &f64| x.is_finite() && *x > 0.0;
    let series: Vec<(String, Vec<f64>)> = (2..header.len())
        .map(|c| (header[c].clone(), rows.iter().map(|r| r[c]).collect()))
        .filter(|(_, v): &(String, Vec<f64>)| v.iter().any(finite))
        .collect();
    let panels = series.len().max(1);
    let root = BitMapBackend::new(out, (1000, 220 * panels as u32 + 60)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled("training loss", ("sans-serif", 28))?;
    let areas = root.split_evenly((panels, 1));
    for (i, ((name, values), area)) in series.iter().zip(areas.iter()).enumerate() {
        let (lo, hi) = values
            .iter()
            .filter(|x| finite(x))
            .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
        let (lo, hi) = ((lo * 0.8).max(hi * 1e-12), hi * 1.25);
        let mut chart = ChartBuilder::on(area)
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(95)
            .caption(name, ("sans-serif", 20))
            .build_cartesian_2d(0.0..x_max, (lo..hi).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("optimizer update")
            .y_label_formatter(&|v| format!("{v:.2e}"))
            .y_labels(5)
            .label_style(("sans-serif", 14))
            .draw()?;
        let color = Palette99::pick(i).to_rgba();
        chart.draw_series(LineSeries::new(
            steps
                .iter()
                .zip(values)
                .filter(|(_, v)| finite(v) && **v >= lo)
                .map(|(s, v)| (*s, *v)),
            color.stroke_width(2),
        ))?;
    }
    root.present()
        .with_context(|| format!("cannot write {}", out.display()))?;
    Ok(())
}

fn plot_raster(spikes: &Path, out: &Path) -> Result<()> {
    let trains = lockstep_sonata::read_spikes(spikes)?;
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
    let t_max = points.iter().map(|p| p.0).fold(1.0, f64::max);
    let n_max = points.iter().map(|p| p.1).fold(1.0, f64::max) + 1.0;
    let root = BitMapBackend::new(out, (1000, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("spikes: {} ({} spikes)", labels.join(", "), points.len()),
            ("sans-serif", 24),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..t_max, 0.0..n_max)?;
    chart
        .configure_mesh()
        .x_desc("time (ms)")
        .y_desc("node id")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style(("sans-serif", 16))
        .draw()?;
    chart.draw_series(
        points
            .iter()
            .map(|&(t, n)| Circle::new((t, n), 1, BLACK.filled())),
    )?;
    root.present()
        .with_context(|| format!("cannot write {}", out.display()))?;
    Ok(())
}

//! PNG plots of a sweep (plotters): TTFP, audio RTF and audio throughput
//! against load, one line per run, so several runs (profiles compared, or
//! earlier results overlaid) read at a glance.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{anyhow, Context, Result};
use plotters::prelude::*;

use super::metrics::Figure;
use super::report::Run;

/// Where a TrueType font usually is on Debian (fonts-dejavu-core) and others.
const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

/// ab_glyph renders text without fontconfig, but needs a font registered once.
fn register_font() -> Result<()> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let from_env = std::env::var("OMNISTREAM_FONT").ok();
        let path = from_env
            .iter()
            .map(String::as_str)
            .chain(FONT_PATHS.iter().copied())
            .find(|p| Path::new(p).exists())
            .ok_or_else(|| {
                "no TrueType font found for the plots: install fonts-dejavu-core or set OMNISTREAM_FONT"
                    .to_string()
            })?;
        let bytes = std::fs::read(path).map_err(|e| format!("reading {path}: {e}"))?;
        // plotters keeps the font for the process's life.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| format!("{path} is not a usable TrueType font"))
    })
    .clone()
    .map_err(|e| anyhow!(e))
}

/// One plotted quantity.
struct Chart {
    file: &'static str,
    title: &'static str,
    y_label: &'static str,
    /// (legend suffix, value) per level; several give several lines per run.
    series: &'static [(&'static str, Figure)],
    /// A horizontal reference line (RTF = 1: real time).
    reference: Option<f64>,
}

const CHARTS: &[Chart] = &[
    Chart {
        file: "ttfp.png",
        title: "Time to first audio packet",
        y_label: "TTFP (ms)",
        series: &[("p50", |m| m.ttfp_ms.median), ("p90", |m| m.ttfp_ms.p90)],
        reference: None,
    },
    Chart {
        file: "rtf.png",
        title: "Audio real-time factor (below 1 keeps up)",
        y_label: "RTF",
        series: &[
            ("p50", |m| m.audio_rtf.median),
            ("p90", |m| m.audio_rtf.p90),
        ],
        reference: Some(1.0),
    },
    Chart {
        file: "throughput.png",
        title: "Audio throughput",
        y_label: "audio seconds per second",
        series: &[("", |m| m.audio_throughput)],
        reference: None,
    },
];

/// Draws every chart into `dir`; returns the files written.
pub fn plot_runs(runs: &[Run], x_label: &str, dir: &Path) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for chart in CHARTS {
        let path = dir.join(chart.file);
        draw(chart, runs, x_label, &path).with_context(|| format!("drawing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

fn draw(chart: &Chart, runs: &[Run], x_label: &str, path: &Path) -> Result<()> {
    let points = |run: &Run, f: Figure| -> Vec<(f64, f64)> {
        run.levels
            .iter()
            .filter(|l| l.metrics.completed > 0 && l.x > 0.0)
            .map(|l| (l.x, f(&l.metrics)))
            .filter(|(_, y)| y.is_finite())
            .collect()
    };
    let mut lines = Vec::new();
    for (i, run) in runs.iter().enumerate() {
        for (k, (suffix, f)) in chart.series.iter().enumerate() {
            lines.push(Line {
                label: if suffix.is_empty() {
                    run.label.clone()
                } else {
                    format!("{} {suffix}", run.label)
                },
                points: points(run, *f),
                color: i,
                // The first series of a chart (the median) is drawn bold.
                bold: k == 0,
            });
        }
    }
    line_chart(
        path,
        &ChartSpec {
            title: chart.title,
            x_label,
            y_label: chart.y_label,
            reference: chart.reference,
        },
        &lines,
    )
}

/// One line of a [`line_chart`].
pub(super) struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    /// Palette index: lines of one run share it.
    pub color: usize,
    pub bold: bool,
}

/// A chart's titles and its optional horizontal reference line (RTF = 1).
pub(super) struct ChartSpec<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub reference: Option<f64>,
}

/// A PNG line chart over a log x axis ticked at the measured x values.
pub(super) fn line_chart(path: &Path, spec: &ChartSpec, lines: &[Line]) -> Result<()> {
    register_font()?;
    let all: Vec<(f64, f64)> = lines
        .iter()
        .flat_map(|l| l.points.iter().copied())
        .collect();
    // Ticks at the measured loads only (a log axis's own ticks repeat labels).
    let mut xs: Vec<f64> = all.iter().map(|p| p.0).collect();
    xs.sort_by(|a, b| a.total_cmp(b));
    xs.dedup();
    let (x_min, x_max) = all.iter().fold((f64::MAX, f64::MIN), |(lo, hi), (x, _)| {
        (lo.min(*x), hi.max(*x))
    });
    let (x_min, x_max) = if all.is_empty() {
        (1.0, 2.0)
    } else {
        (x_min / 1.3, x_max * 1.3)
    };
    let y_max = all
        .iter()
        .map(|p| p.1)
        .chain(spec.reference)
        .fold(0.0, f64::max)
        .max(1e-3)
        * 1.15;

    let root = BitMapBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut ctx = ChartBuilder::on(&root)
        .caption(spec.title, ("sans-serif", 26))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(
            (x_min..x_max).log_scale().with_key_points(xs.clone()),
            0.0..y_max,
        )?;
    ctx.configure_mesh()
        .x_desc(spec.x_label)
        .y_desc(spec.y_label)
        .x_label_formatter(&|x| format!("{x}"))
        .y_label_formatter(&|y| {
            if y_max > 20.0 {
                format!("{y:.0}")
            } else {
                format!("{y:.2}")
            }
        })
        .light_line_style(BLACK.mix(0.04))
        .label_style(("sans-serif", 16))
        .draw()?;
    if let Some(r) = spec.reference {
        ctx.draw_series(LineSeries::new(
            [(x_min, r), (x_max, r)],
            BLACK.mix(0.4).stroke_width(1),
        ))?;
    }
    for line in lines {
        let color = Palette99::pick(line.color).to_rgba();
        let style = if line.bold {
            color.stroke_width(3)
        } else {
            color.mix(0.6).stroke_width(1)
        };
        ctx.draw_series(LineSeries::new(line.points.clone(), style))?
            .label(line.label.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], style));
        ctx.draw_series(
            line.points
                .iter()
                .map(|p| Circle::new(*p, 4, style.filled())),
        )?;
    }
    ctx.configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .label_font(("sans-serif", 16))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    root.present()?;
    Ok(())
}

//! The bench's plot: p99 time to first token against load, one line per setting.

use std::path::Path;

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;

/// One line: its label and its `(load %, p99 TTFT ms)` points.
pub struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

impl Line {
    /// A line over `loads` (shares of capacity), `p99` giving its value at a load in %.
    pub fn over_loads(label: String, loads: &[f64], p99: impl Fn(u32) -> f64) -> Self {
        let points = loads
            .iter()
            .map(|&l| {
                let load = (l * 100.0).round() as u32;
                (f64::from(load), p99(load))
            })
            .collect();
        Self { label, points }
    }
}

/// How a label names a replica count: "1 replica", "4 replicas".
pub fn replicas(n: usize) -> String {
    if n == 1 {
        "1 replica".to_string()
    } else {
        format!("{n} replicas")
    }
}

/// The time axis: linear, or logarithmic for lines that span orders of magnitude (an
/// overloaded setting next to one that keeps up).
#[allow(dead_code)] // each bench draws one
#[derive(Clone, Copy, Debug)]
pub enum Scale {
    Linear,
    Log,
}

/// Writes an SVG of `lines` to `path`, creating its directory.
pub fn p99_ttft(
    path: &Path,
    title: &str,
    lines: &[Line],
    scale: Scale,
) -> Result<(), Box<dyn std::error::Error>> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let ys = lines.iter().flat_map(|l| l.points.iter().map(|p| p.1));
    match scale {
        Scale::Linear => {
            let hi = ys.fold(0f64, f64::max) * 1.15;
            let desc = "p99 time to first token, ms";
            draw(path, title, lines, 0f64..hi.max(10.0), desc)
        }
        Scale::Log => {
            let (lo, hi) = ys.fold((f64::MAX, 0f64), |(lo, hi), y| (lo.min(y), hi.max(y)));
            let (lo, hi) = ((lo * 0.7).max(1.0), (hi * 1.5).max(10.0));
            let desc = "p99 time to first token, ms (log scale)";
            draw(path, title, lines, (lo..hi).log_scale(), desc)
        }
    }
}

/// [`p99_ttft`] on the time axis `y`, described `y_desc`.
fn draw<Y>(
    path: &Path,
    title: &str,
    lines: &[Line],
    y: Y,
    y_desc: &str,
) -> Result<(), Box<dyn std::error::Error>>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let root = SVGBackend::new(path, (820, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d(45f64..100f64, y)?;
    chart
        .configure_mesh()
        .x_desc("offered load, % of the deployment's capacity")
        .y_desc(y_desc)
        .x_labels(12)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .light_line_style(WHITE)
        .draw()?;
    let colours = [RED, BLUE, BLACK, GREEN, MAGENTA, CYAN];
    for (line, colour) in lines.iter().zip(colours) {
        let style = ShapeStyle::from(&colour).stroke_width(2);
        chart
            .draw_series(LineSeries::new(line.points.iter().copied(), style))?
            .label(line.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
        chart.draw_series(
            line.points
                .iter()
                .map(|&p| Circle::new(p, 4, ShapeStyle::from(&colour).filled())),
        )?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

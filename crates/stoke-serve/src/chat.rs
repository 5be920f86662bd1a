//! Chat templates: the Jinja template a model file carries (GGUF `tokenizer.chat_template`, or
//! a model directory's), rendered with minijinja and Python's string methods, as Hugging Face's
//! `apply_chat_template` renders it.

use minijinja::{Environment, Error, ErrorKind, Value, context};

/// ChatML, for a model whose file has no template but whose tokenizer has ChatML's tokens.
pub const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + \
message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ \
'<|im_start|>assistant\\n' }}{% endif %}";

/// One message as the template sees it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TemplateMessage {
    pub role: String,
    pub content: String,
}

/// A model's chat template, ready to render.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; `bos` and `eos` are the model's special tokens as text.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<Self, Error> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| strftime_now(&fmt));
        env.add_template_owned("chat", source.to_string())?;
        Ok(Self {
            env,
            bos: bos.into(),
            eos: eos.into(),
        })
    }

    /// The prompt for `messages`, ending where the assistant's reply starts.
    pub fn render(&self, messages: &[TemplateMessage]) -> Result<String, Error> {
        self.env.get_template("chat")?.render(context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos,
            eos_token => self.eos,
        })
    }
}

/// Today's date (UTC) in `fmt`: `%d %b %Y` and the other fields date-stamped templates use
/// (`%d %m %Y %y %b %B %H %M %S %%`).
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format_date(secs, fmt)
}

fn format_date(secs: u64, fmt: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let days = (secs / 86400) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let tod = secs % 86400;
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let name = MONTHS[(month - 1) as usize];
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&name[..3]),
            Some('B') => out.push_str(name),
            Some('H') => out.push_str(&format!("{:02}", tod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", tod / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", tod % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(m: &[(&str, &str)]) -> Vec<TemplateMessage> {
        m.iter()
            .map(|(r, c)| TemplateMessage {
                role: r.to_string(),
                content: c.to_string(),
            })
            .collect()
    }

    #[test]
    fn chatml_and_python_methods_render() {
        let t = ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap();
        let p = t.render(&msgs(&[("user", "Hi")])).unwrap();
        assert_eq!(p, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
        // What Llama-3 style templates use: strip(), raise_exception, bos_token.
        let src = "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}\
                   {{ raise_exception('no tools') }}{% endif %}{{ m['content'].strip() }}|\
                   {% endfor %}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        assert_eq!(
            t.render(&msgs(&[("user", "  a "), ("assistant", "b")]))
                .unwrap(),
            "<s>a|b|"
        );
        let e = t.render(&msgs(&[("tool", "x")])).unwrap_err();
        assert!(e.to_string().contains("no tools"), "{e}");
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
    }

    #[test]
    fn dates_format() {
        // 2024-07-26 12:34:56 UTC.
        assert_eq!(format_date(1_721_997_296, "%d %b %Y"), "26 Jul 2024");
        assert_eq!(
            format_date(1_721_997_296, "%Y-%m-%d %H:%M:%S %B %%"),
            "2024-07-26 12:34:56 July %"
        );
        assert_eq!(format_date(951_782_400, "%d %m %Y"), "29 02 2000");
    }
}

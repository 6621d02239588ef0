//! Shader assembly: a WGSL template whose `{{NAME}}` placeholders are filled by name, after
//! the parts it needs (shared declarations, a weight format's snippet) are put before it.
//! Filling a name the template does not have, or leaving any placeholder unfilled, is an error
//! naming the shader: a template edit can never be silently ignored.

use anyhow::{bail, Result};

pub struct Shader {
    label: String,
    prefix: Vec<String>,
    body: String,
    errors: Vec<String>,
}

impl Shader {
    pub fn new(label: impl Into<String>, body: &str) -> Shader {
        Shader { label: label.into(), prefix: Vec::new(), body: body.to_string(), errors: Vec::new() }
    }

    /// Puts `part` before the template (after the parts already put there).
    pub fn after(mut self, part: impl Into<String>) -> Shader {
        self.prefix.push(part.into());
        self
    }

    /// Fills every `{{name}}` of the template (and of values filled before) with `value`.
    pub fn fill(mut self, name: &str, value: impl std::fmt::Display) -> Shader {
        let key = format!("{{{{{name}}}}}");
        if self.body.contains(&key) {
            self.body = self.body.replace(&key, &value.to_string());
        } else {
            self.errors.push(format!("it has no placeholder {key}"));
        }
        self
    }

    /// `fill` where `cond` holds (a placeholder only one variant of a template has).
    pub fn fill_if(self, cond: bool, name: &str, value: impl std::fmt::Display) -> Shader {
        if cond {
            self.fill(name, value)
        } else {
            self
        }
    }

    /// The whole source, or why the template and its values do not match.
    pub fn build(self) -> Result<String> {
        let mut src = self.prefix.join("\n");
        src.push('\n');
        src.push_str(&self.body);
        let mut errors = self.errors;
        if let Some(i) = src.find("{{") {
            let name: String = src[i..].chars().take_while(|&c| c != '\n').take(40).collect();
            errors.push(format!("placeholder {name} is left unfilled"));
        }
        if !errors.is_empty() {
            bail!("shader {}: {}", self.label, errors.join("; "));
        }
        Ok(src)
    }
}

#[cfg(test)]
mod tests {
    use super::Shader;

    #[test]
    fn fills_by_name_and_refuses_mismatches() {
        let s = Shader::new("t", "const A = {{A}}u;\n{{B}}").after("// common").fill("B", "const C = {{A}};");
        assert_eq!(s.fill("A", 3).build().unwrap(), "// common\nconst A = 3u;\nconst C = 3;");
        let e = Shader::new("t", "x {{A}}").build().unwrap_err().to_string();
        assert!(e.contains("shader t") && e.contains("{{A}} is left unfilled"), "{e}");
        let e = Shader::new("t", "x {{A}}").fill("A", 1).fill("Z", 2).build().unwrap_err().to_string();
        assert!(e.contains("no placeholder {{Z}}"), "{e}");
        // A placeholder inside a prefix part is caught too.
        assert!(Shader::new("t", "x").after("{{P}}").build().is_err());
    }
}
